"""A stand-in for one etcd member's v3 JSON gateway, as far as ``/v3/maintenance/status`` goes: what gradsync doctor
and the etcd client's address parsing are tested against where no etcd is installed (tests/test_etcd_store.py runs
a real cluster)."""

from __future__ import annotations

import http.server
import json


class FakeEtcdMember(http.server.BaseHTTPRequestHandler):
    """Answers a status request with etcd 3.4's version and a leader's id; any other path is a 404."""

    leader = "8211f1d0f64f3269"

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = json.dumps({"version": "3.4.30", "leader": self.leader}).encode()
        self.send_response(200 if self.path == "/v3/maintenance/status" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass
