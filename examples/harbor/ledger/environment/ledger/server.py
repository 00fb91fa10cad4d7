"""A ledger kept in memory: GET /entries lists it, POST /entries {"name": ...} adds one."""
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

assert sys.version_info >= (3, 12), "this image's Python is 3.12 or later"
ENTRIES = [{"id": 1, "name": "genesis"}]


class Ledger(BaseHTTPRequestHandler):
    def _answer(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path != "/entries":
            return self._answer(404, {"error": "no such path"})
        self._answer(200, ENTRIES)

    def do_POST(self):
        if self.path != "/entries":
            return self._answer(404, {"error": "no such path"})
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        entry = {"id": len(ENTRIES) + 1, "name": str(body.get("name", ""))}
        ENTRIES.append(entry)
        self._answer(201, entry)


ThreadingHTTPServer(("0.0.0.0", 8080), Ledger).serve_forever()
