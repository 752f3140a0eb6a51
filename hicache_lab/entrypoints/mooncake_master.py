"""The `mooncake_master` a run with `--hicache-storage-backend mooncake` starts for itself on 127.0.0.1 (with its
HTTP metadata server), and stops at its end; it dies with the launcher, even by SIGKILL (ending.master_preexec).
A master that cannot start (a missing system library: exit 127) is a ConfigError naming what to install."""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from ..errors import ConfigError
from ..mem_cache.mooncake_store import MOONCAKE_INSTALL
from .ending import master_preexec


def stop_master(master: subprocess.Popen) -> None:
    master.terminate()
    master.wait()


def start_mooncake_master() -> tuple[subprocess.Popen, str, str]:
    """Start `mooncake_master` on 127.0.0.1 with its HTTP metadata server; returns (process, master address,
    metadata URL). The caller stops it; it dies with this process."""
    import mooncake  # optional dependency: imported only when asked for

    binary = Path(mooncake.__file__).parent / "mooncake_master"
    rpc, http, metrics = free_ports(3)
    errors = tempfile.TemporaryFile()  # noqa: SIM115 - what the master says if it cannot start; closed below
    process = subprocess.Popen(
        [
            str(binary),
            f"--port={rpc}",
            "--rpc_address=127.0.0.1",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={http}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={metrics}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=errors,
        preexec_fn=master_preexec(os.getpid()),  # it dies with the launcher, even by SIGKILL
    )
    deadline = time.monotonic() + 10
    with errors:
        while not _listening(rpc) and time.monotonic() < deadline:
            if process.poll() is not None:
                errors.seek(0)
                said = errors.read().decode(errors="replace").strip().splitlines()[-1:] or ["nothing"]
                hint = f" ({MOONCAKE_INSTALL})" if process.returncode == 127 else ""  # the loader: a library missing
                raise ConfigError(
                    f"--hicache-storage-backend mooncake: {binary.name} exited with code {process.returncode} "
                    f"before it listened, saying: {said[0]}{hint}; or use --hicache-storage-backend file"
                )
            time.sleep(0.1)
    return process, f"127.0.0.1:{rpc}", f"http://127.0.0.1:{http}/metadata"


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free on 127.0.0.1 right now."""
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
