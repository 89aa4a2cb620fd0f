"""The object stores the conformance tests (test_store_conformance.py) run against: each a real,
independently written server of its kind, started on 127.0.0.1 on a free port by the tests and
stopped by them.

Every store has one interface, so that one conformance list runs against all of them:

- ``start()`` / ``stop()``: the server runs only between the two; ``stop()`` waits for it to end.
  ``start()`` raises :class:`StoreUnavailable` (the tests skip, saying why) when this machine
  cannot run the server, never a pass.
- ``url_for(path)``: the location tessera is given (``s3://<bucket>/<path>``).
- ``env``: the variables a tessera process needs for it (``storage_options=`` of the Python calls,
  the environment of a ``tessera`` command): the endpoint and credentials users set for the store.
- ``served(prefix)`` / ``changes(prefix)`` / ``reset()``: GET requests and body bytes the server
  sent for keys that start with ``prefix``, and the objects it created and deleted under it in
  order, both recorded at the server (never by the client whose account is being checked).
- ``upload(directory, path)``, ``keys(path)``, ``read(path)``, ``write(path, data)``: the test's
  own access to the store through the store's own client, to put fixtures there and to look at
  what tessera left behind.

Only moto (S3) is here so far; an Azurite or fake-gcs-server launcher implements the same methods.
The project's own S3 server (``storage/src/testing/s3_server.rs``) stays for the tests that need
what no independent server does: stalls, throttled links and injected faults.

Run as a script (``python stores.py moto``), this file is the moto server process itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional


class StoreUnavailable(Exception):
    """This machine cannot run the store's server (the reason says what is missing)."""


class Store:
    """One store; see the module documentation."""

    name = ""
    scheme = ""
    bucket = "tessera-conformance"

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def url_for(self, path: str) -> str:
        return f"{self.scheme}://{self.bucket}/{path.strip('/')}"

    @property
    def env(self) -> Dict[str, str]:
        raise NotImplementedError

    def served(self, prefix: str = "") -> Dict[str, int]:
        """``{"get_requests", "get_body_bytes"}`` the server answered for keys that start with
        ``prefix`` (``run/c/__`` takes in DCP's ``__0_0.distcp`` files; listings are not
        included), counted by the server as it sent them."""
        raise NotImplementedError

    def changes(self, prefix: str) -> List[tuple]:
        """``("create" | "delete", key)`` for each object under ``prefix`` (keys relative to
        it) that a request created or deleted, in the order the server answered them."""
        raise NotImplementedError

    def reset(self) -> None:
        """Forgets what was served and changed so far."""
        raise NotImplementedError

    def upload(self, directory: Path, path: str) -> None:
        raise NotImplementedError

    def keys(self, path: str) -> List[str]:
        raise NotImplementedError

    def read(self, path: str) -> Optional[bytes]:
        raise NotImplementedError

    def write(self, path: str, data: bytes) -> None:
        raise NotImplementedError


class MotoS3(Store):
    """S3 as moto's server mode implements it (``moto[server]``: ``ThreadedMotoServer``), in its
    own process: a server in the test's process would share its interpreter lock with tessera
    calls that hold it, and could not be counted on to answer them. The process counts what it
    serves and answers ``served <prefix>``, ``changes <prefix>`` and ``reset`` on its stdin, one
    JSON line each; closing its stdin stops it."""

    name = "moto"
    scheme = "s3"
    ACCESS_KEY_ID = "tessera-conformance"
    SECRET_ACCESS_KEY = "tessera-conformance-secret"
    REGION = "us-east-1"

    def __init__(self) -> None:
        self.proc: Optional[subprocess.Popen] = None
        self.endpoint = ""
        self._log = None
        self._client = None

    def start(self) -> None:
        try:
            import boto3  # noqa: F401  (moto[server] brings it)
            import moto.server  # noqa: F401
        except ImportError as e:
            raise StoreUnavailable(f"moto[server] is not installed ({e}): `make python-env` installs it")
        self._log = tempfile.NamedTemporaryFile(prefix="moto-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "moto"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
        )
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait(timeout=30)
            raise StoreUnavailable(f"the moto server exited with {code} before serving: {self.log_tail()}")
        self.endpoint = json.loads(line)["endpoint"]
        self.client().create_bucket(Bucket=self.bucket)

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        finally:
            self.proc = None
            if self._log is not None:
                self._log.close()
                os.unlink(self._log.name)
                self._log = None

    def log_tail(self, lines: int = 20) -> str:
        if self._log is None:
            return ""
        return "\n".join(Path(self._log.name).read_text(errors="replace").splitlines()[-lines:])

    @property
    def env(self) -> Dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": self.ACCESS_KEY_ID,
            "AWS_SECRET_ACCESS_KEY": self.SECRET_ACCESS_KEY,
            "AWS_REGION": self.REGION,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ALLOW_HTTP": "true",
        }

    def _ask(self, line: str) -> dict:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"the moto server exited: {self.log_tail()}")
        return json.loads(answer)

    def served(self, prefix: str = "") -> Dict[str, int]:
        return self._ask(f"served /{self.bucket}/{prefix.lstrip('/')}")

    def changes(self, prefix: str = "") -> List[tuple]:
        under = f"/{self.bucket}/{prefix.strip('/')}/"
        answer = self._ask(f"changes {under}")["changes"]
        start = len(under)
        return [(what, path[start:]) for what, path in answer]

    def reset(self) -> None:
        self._ask("reset")

    def client(self):
        if self._client is None:
            import boto3

            self._client = boto3.client(
                "s3", endpoint_url=self.endpoint, region_name=self.REGION,
                aws_access_key_id=self.ACCESS_KEY_ID, aws_secret_access_key=self.SECRET_ACCESS_KEY,
            )
        return self._client

    def _key(self, path: str) -> str:
        return path.strip("/")

    def upload(self, directory: Path, path: str) -> None:
        for file in sorted(p for p in Path(directory).rglob("*") if p.is_file()):
            key = f"{self._key(path)}/{file.relative_to(directory).as_posix()}"
            self.client().put_object(Bucket=self.bucket, Key=key, Body=file.read_bytes())

    def keys(self, path: str) -> List[str]:
        prefix = self._key(path)
        prefix = f"{prefix}/" if prefix else ""
        found = []
        for page in self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            found += [o["Key"][len(prefix):] for o in page.get("Contents", [])]
        return sorted(found)

    def read(self, path: str) -> Optional[bytes]:
        try:
            return self.client().get_object(Bucket=self.bucket, Key=self._key(path))["Body"].read()
        except self.client().exceptions.NoSuchKey:
            return None

    def write(self, path: str, data: bytes) -> None:
        self.client().put_object(Bucket=self.bucket, Key=self._key(path), Body=data)


# Every store the conformance list runs against, by name.
STORES = {"moto": MotoS3}


def _serve_moto() -> None:
    """The moto server process: ThreadedMotoServer on 127.0.0.1, a free port, its WSGI app
    wrapped in a counter of the GET bodies it sends and a log of the objects it creates and
    deletes."""
    import io
    import re
    import threading
    from html import unescape
    from urllib.parse import parse_qs

    from moto.moto_server.threaded_moto_server import ThreadedMotoServer
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    gets: List[list] = []  # [URI path, body bytes sent] per GET
    changes: List[tuple] = []  # ("create" | "delete", URI path) per object, in the order answered
    lock = threading.Lock()

    def counted(app):
        def wrapped(environ, start_response):
            status = []

            def start(code, headers, *rest):
                status.append(int(code.split()[0]))
                return start_response(code, headers, *rest)

            method = environ.get("REQUEST_METHOD", "")
            path = environ.get("PATH_INFO", "")
            query = parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
            deleted = []
            if method == "POST" and "delete" in query:
                # A bulk delete names its keys in the body: read it here, hand moto a copy.
                length = int(environ.get("CONTENT_LENGTH") or 0)
                request = environ["wsgi.input"].read(length)
                environ["wsgi.input"] = io.BytesIO(request)
                deleted = [f"{path.rstrip('/')}/{unescape(k)}" for k in re.findall(r"<Key>(.*?)</Key>", request.decode())]
            body = app(environ, start)
            if method != "GET":
                if status and status[0] < 300:
                    # Logged before the answer goes out: a client that has its answer finds it here.
                    if method == "PUT" and "partNumber" not in query:
                        event = [("create", path)]
                    elif method == "POST" and "uploadId" in query:
                        event = [("create", path)]  # a multipart upload completes: the object appears
                    elif method == "DELETE" and "uploadId" not in query:
                        event = [("delete", path)]
                    else:
                        event = [("delete", key) for key in deleted]
                    with lock:
                        changes.extend(event)
                return body
            entry = [environ.get("PATH_INFO", ""), 0]
            with lock:
                gets.append(entry)

            # Each chunk is counted before it is handed to the socket, so a client that has its
            # last byte never asks before the count has it.
            def sent():
                try:
                    for chunk in body:
                        with lock:
                            entry[1] += len(chunk)
                        yield chunk
                finally:
                    if hasattr(body, "close"):
                        body.close()

            return sent()

        return wrapped

    class CountingMotoServer(ThreadedMotoServer):
        def _server_entry(self) -> None:
            app = counted(DomainDispatcherApplication(create_backend_app))
            self._server = make_server(
                self._ip_address, self._port, app, True, request_handler=MotoRequestHandler
            )
            self._server_ready_event.set()
            self._server.serve_forever()

    server = CountingMotoServer("127.0.0.1", 0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    print(json.dumps({"endpoint": f"http://{host}:{port}"}), flush=True)
    try:
        for line in sys.stdin:
            command, _, arg = line.strip().partition(" ")
            with lock:
                if command == "served":
                    hits = [n for p, n in gets if p.startswith(arg)]
                    answer = {"get_requests": len(hits), "get_body_bytes": sum(hits)}
                elif command == "changes":
                    answer = {"changes": [c for c in changes if c[1].startswith(arg)]}
                elif command == "reset":
                    gets.clear()
                    changes.clear()
                    answer = {}
                else:
                    answer = {"error": f"unknown command {command!r}"}
            print(json.dumps(answer), flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    if sys.argv[1:] != ["moto"]:
        sys.exit(f"usage: {sys.argv[0]} moto")
    _serve_moto()
