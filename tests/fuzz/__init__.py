"""Fuzzing the gateway's HTTP server, replica client and request parsing (harness.py; see docs/fuzzing.md)."""
