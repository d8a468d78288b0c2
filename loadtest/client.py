"""The streaming HTTP client the locustfile sends with (geventhttpclient: runs under gevent).

One connection pool per host, as large as `max_connections`, so an open-loop run is never held back
by the client: a request waits for a pooled connection only past that many in flight.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from gevent import GreenletExit
from geventhttpclient import HTTPClient
from geventhttpclient.response import HTTPParseError, HTTPSocketPoolResponse

from loadtest.config import LoadConfig
from loadtest.payload import request_body
from loadtest.records import RequestRecord
from loadtest.sse import RequestFailed, StreamMeter, error_reason
from loadtest.workloads import RequestSpec

logger = logging.getLogger(__name__)

REPLICA_HEADER = "x-gateway-replica"
MAX_ERROR_BODY = 64 * 1024


class StreamingClient:
    """Sends each request to one of the hosts (`LoadConfig.host_of`) and measures it into a RequestRecord."""

    def __init__(self, config: LoadConfig, api_key: str | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._config = config
        self._clock = clock
        self._t0 = clock()
        self._clients = [
            HTTPClient.from_url(host, concurrency=config.max_connections,
                                connection_timeout=config.connect_timeout, network_timeout=config.read_timeout)
            for host in config.hosts
        ]
        self._paths = [urlsplit(host).path.rstrip("/") + config.path for host in config.hosts]
        self._headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"

    def start_clock(self) -> None:
        """Make now time zero for the records."""
        self._t0 = self._clock()

    def now(self) -> float:
        """Seconds since time zero."""
        return self._clock() - self._t0

    def close(self) -> None:
        for client in self._clients:
            client.close()

    def send(self, request: RequestSpec, scheduled_s: float | None) -> RequestRecord:
        """Send one streaming request; never raises for the request's own failures."""
        return self.exchange(request, scheduled_s)[0]

    def exchange(self, request: RequestSpec, scheduled_s: float | None) -> tuple[RequestRecord, str]:
        """Send one streaming request; its record and the reply's text ("" when it failed)."""
        target = self._config.host_of(request)
        body = json.dumps(request_body(self._config.model, self._config.endpoint, request,
                                       self._config.ignore_eos)).encode()
        sent = self.now()
        meter = StreamMeter(sent)
        status, replica, error, result = 0, None, None, None
        response: HTTPSocketPoolResponse | None = None
        try:
            response = self._clients[target].request("POST", self._paths[target], body=body, headers=self._headers)
            status = response.status_code
            replica = response.get(REPLICA_HEADER)
            if status != 200:
                raise RequestFailed(error_reason(status, response.read(MAX_ERROR_BODY)))
            while line := response.readline(b"\n"):
                meter.feed(line, self.now())
            result = meter.finish()
        except RequestFailed as e:
            error = str(e)
        except TimeoutError:
            error = f"timeout: no data for {self._config.read_timeout:g} s"
        except (OSError, HTTPParseError) as e:
            error = f"{'connection broken mid-stream' if status else 'connection failed'}: {type(e).__name__}"
        except GreenletExit:
            error = "cancelled: still in flight when the run ended"
        finally:
            if response is not None and (error or result is None):
                _discard(response)
        return RequestRecord(
            index=request.index, target=self._config.hosts[target], scheduled_s=scheduled_s, sent_s=sent,
            end_s=self.now(), ok=error is None, status=status, error=error,
            replica=replica if isinstance(replica, str) else None,
            ttft_s=result.ttft_s if result else None, itl_s=result.itl_s if result else (),
            output_tokens=result.output_tokens if result else meter.tokens_so_far,
            prompt_tokens=result.prompt_tokens if result else None,
            requested_prompt_tokens=request.prompt_tokens, max_tokens=request.max_tokens,
            conversation=request.conversation, turn=request.turn,
        ), result.text if result else ""


def _discard(response: HTTPSocketPoolResponse) -> None:
    """Close the connection of a half-read response so it never goes back to the pool."""
    # geventhttpclient would pool a socket whose stream we abandoned if the server happens to be
    # quiet at that moment; the next request on it would then read this one's leftovers.
    sock = getattr(response, "_sock", None)
    if sock is not None:
        sock.close()
    response.release()
