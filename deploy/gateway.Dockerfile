# The smallserve gateway image (no vLLM inside: the replicas run in vllm/vllm-openai containers).
#   docker build -f deploy/gateway.Dockerfile -t smallserve-gateway:0.1.0 .
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY deploy ./deploy
COPY planner ./planner
COPY loadtest ./loadtest
COPY sim ./sim
RUN pip install --no-cache-dir . && useradd --uid 10001 --no-create-home smallserve
USER smallserve
EXPOSE 8000
HEALTHCHECK --interval=5s --timeout=3s CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)"
ENTRYPOINT ["gateway"]
CMD ["serve", "--config", "/etc/smallserve/gateway.yaml"]
