"""A real S3 endpoint for tests: moto's S3 application served on 127.0.0.1, one bucket.

Example:
    >>> with MotoS3() as s3:                                           # doctest: +SKIP
    ...     tier = S3Tier(s3.url("warm"), s3.storage_options, name="warm")
    ...     s3.stop()       # simulate an outage
    ...     s3.start()      # same port, same objects

moto keeps its state per process, not per server, so stopping and starting the server keeps
every object; each ``MotoS3`` uses its own random bucket so instances never see each other.

The server is moto's own request handling (its S3 application, its werkzeug request handler)
without the front that finds out which of moto's ~200 AWS services a request is for: that
front lists moto's packages on disk and tries the URL patterns of every service until S3's
matches, again for every request (about 0.8 ms of CPU each, under a lock every request
thread takes). Only S3 is served here, so every request goes to the S3 application; moto's
``/moto-api`` paths still go through moto's front.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from pathlib import Path
from typing import Any

__all__ = ["FAKE_ACCESS_KEY_ID", "FAKE_SECRET_ACCESS_KEY", "MotoS3"]

logger = logging.getLogger(__name__)

FAKE_ACCESS_KEY_ID = "testing-key-id"
FAKE_SECRET_ACCESS_KEY = "testing-secret"

_ENV_VARS = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_DEFAULT_REGION",
    "AWS_PROFILE",
)


def _s3_application() -> Any:
    """moto's WSGI front with every request but ``/moto-api`` sent to its S3 application."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app

    # moto is not type-analysed (pyproject.toml: mypy follow_imports = "skip"), so its base is Any.
    class S3Only(DomainDispatcherApplication):  # type: ignore[misc]
        def get_application(self, environ: dict[str, Any]) -> Any:
            if str(environ.get("PATH_INFO", "")).startswith("/moto-api"):
                return super().get_application(environ)
            with self.lock:
                app = self.app_instances.get("s3")
                if app is None:
                    app = self.app_instances["s3"] = self.create_app("s3")
                return app

    return S3Only(create_backend_app)


class MotoS3:
    """Context manager running a moto S3 server and creating one bucket.

    While entered, fake AWS credentials are set in ``os.environ`` (the previous values are
    restored on exit), so s3fs and boto3 authenticate against moto and never reach AWS.

    Attributes:
        bucket: The bucket created on entry.
        endpoint_url: ``http://127.0.0.1:<port>``.
    """

    def __init__(
        self,
        bucket: str | None = None,
        *,
        access_key_id: str = FAKE_ACCESS_KEY_ID,
        secret_access_key: str = FAKE_SECRET_ACCESS_KEY,
        region: str = "us-east-1",
        fail_fast: bool = True,
    ) -> None:
        """Configure the server (nothing starts before ``__enter__``).

        Args:
            bucket: Bucket name (default: a random ``ckpt-test-...`` name).
            access_key_id: Fake access key id put in the environment.
            secret_access_key: Fake secret put in the environment (tests use a marker here
                to prove it never leaks into messages).
            region: AWS region put in the environment.
            fail_fast: Make :attr:`storage_options` use one botocore attempt and a 2 s
                connect timeout, so an outage surfaces in about a second, not fifteen.
        """
        self.bucket = bucket or f"ckpt-test-{uuid.uuid4().hex[:12]}"
        self._env = {
            "AWS_ACCESS_KEY_ID": access_key_id,
            "AWS_SECRET_ACCESS_KEY": secret_access_key,
            "AWS_DEFAULT_REGION": region,
        }
        self._saved: dict[str, str | None] = {}
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._port = 0
        self._fail_fast = fail_fast
        self.endpoint_url = ""

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> MotoS3:
        self._saved = {var: os.environ.get(var) for var in _ENV_VARS}
        for var in _ENV_VARS:
            os.environ.pop(var, None)
        os.environ.update(self._env)
        try:
            self.start()
            self.client().create_bucket(Bucket=self.bucket)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        for var, value in self._saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value

    def start(self) -> None:
        """Start (or restart) the server; a restart reuses the first port."""
        if self._server is not None:
            return
        from moto.moto_server.werkzeug_app import MotoRequestHandler
        from werkzeug.serving import make_server

        # werkzeug logs every request at INFO through its own stderr handler; that drowns
        # test output (and a test's caplog) in access lines.
        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        server = make_server("127.0.0.1", self._port, _s3_application(), threaded=True,
                             request_handler=MotoRequestHandler)
        thread = threading.Thread(target=server.serve_forever, name="moto-s3", daemon=True)
        thread.start()
        self._server, self._thread = server, thread
        self._port = int(server.server_address[1])
        self.endpoint_url = f"http://127.0.0.1:{self._port}"
        logger.debug("moto S3 server listening on %s", self.endpoint_url)

    def stop(self) -> None:
        """Stop the server (objects stay in moto's memory for a later :meth:`start`)."""
        if self._server is not None:
            server, self._server = self._server, None
            server.shutdown()
            server.server_close()  # the port is free for a restart at once
            if self._thread is not None:
                self._thread.join()

    @property
    def running(self) -> bool:
        """Whether the server is up."""
        return self._server is not None

    # ------------------------------------------------------------------ helpers
    @property
    def storage_options(self) -> dict[str, Any]:
        """s3fs options for this endpoint (no credentials: those are in the environment)."""
        options: dict[str, Any] = {"endpoint_url": self.endpoint_url}
        if self._fail_fast:
            options["config_kwargs"] = {
                "connect_timeout": 2,
                "read_timeout": 20,
                "retries": {"max_attempts": 1, "mode": "standard"},
            }
        return options

    def url(self, prefix: str = "") -> str:
        """``s3://<bucket>/<prefix>``."""
        prefix = prefix.strip("/")
        return f"s3://{self.bucket}/{prefix}" if prefix else f"s3://{self.bucket}"

    def config_toml(self, root: Path | str, prefix: str,
                    cold_storage_class: str = "STANDARD_IA") -> str:
        """A store's config file with ``root``, and warm and cold tiers under ``prefix`` of
        this server's bucket (credentials stay in the environment)."""
        return (
            f'root = "{root}"\n'
            "[tiers]\n"
            f'warm = "{self.url(prefix + "/warm")}"\n'
            f'cold = "{self.url(prefix + "/cold")}"\n'
            f'cold_storage_class = "{cold_storage_class}"\n'
            "[storage_options]\n"
            f'endpoint_url = "{self.endpoint_url}"\n'
        )

    def client(self) -> Any:
        """A boto3 S3 client for this endpoint (for test set-up and fault injection)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=self._env["AWS_DEFAULT_REGION"],
            aws_access_key_id=self._env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self._env["AWS_SECRET_ACCESS_KEY"],
        )

    def keys(self, prefix: str = "") -> list[str]:
        """All object keys in the bucket under ``prefix`` (bounded to 10,000)."""
        client = self.client()
        out: list[str] = []
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
        for _ in range(10):
            page = client.list_objects_v2(**kwargs)
            out.extend(obj["Key"] for obj in page.get("Contents", []))
            if not page.get("IsTruncated"):
                break
            kwargs["ContinuationToken"] = page["NextContinuationToken"]
        return sorted(out)
