"""The share guard (docs/testing.md, "No public share link"): one per test process.

`ui --share` makes Gradio open a tunnel: it asks api.gradio.app for a share server (unless
GRADIO_SHARE_SERVER_ADDRESS names one), downloads its `frpc` client into $HF_HOME/gradio/frpc when missing,
and runs it against that server. For the whole test run, in this process and every server it starts (they
inherit the environment), the share server is a 127.0.0.1 port held by a socket that never listens (so a
connection to it is refused), and $HF_HOME holds a stand-in `frpc` that records its arguments and reports a
refused login at once: no request leaves the machine even where it has internet. tests/test_ui_share.py
proves it. Installed when this module is first imported (tests/conftest.py imports it), so servers started
by fixtures of any scope see it; a module is imported once per process, so there is one guard whatever
name the conftest is imported under.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import platform
import re
import shutil
import socket
import tempfile
from pathlib import Path


class ShareGuard:
    def __init__(self) -> None:
        self.holder = socket.socket()
        self.holder.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        self.address = f"127.0.0.1:{self.holder.getsockname()[1]}"
        self.root = Path(tempfile.mkdtemp(prefix="omni-test-share-guard-"))
        self.calls_path = self.root / "frpc-calls.log"
        self.calls_path.touch()
        self.client = self.root / "hf" / "gradio" / "frpc" / _gradio_frpc_name()
        self.client.parent.mkdir(parents=True)
        self.client.write_text(
            "#!/bin/sh\n"
            "# Gradio's share tunnel client, replaced for the test run (tests/share_guard.py, docs/testing.md)\n"
            f"printf '%s\\n' \"$*\" >> '{self.calls_path}'\n"
            "echo 'login to server failed: refused by the test suite share guard (tests/share_guard.py)'\n"
            "exit 1\n"
        )
        self.client.chmod(0o755)

    def install(self) -> None:
        hf_home = os.environ.get("HF_HOME") or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
        )
        # models already in the Hub cache stay where they are; only Gradio's frpc folder moves
        hub_cache = os.environ.get("HUGGINGFACE_HUB_CACHE") or os.path.join(hf_home, "hub")
        os.environ.setdefault("HF_HUB_CACHE", hub_cache)
        os.environ["HF_HOME"] = str(self.root / "hf")
        os.environ["GRADIO_SHARE_SERVER_ADDRESS"] = self.address

    def calls(self) -> list[list[str]]:
        """The stand-in frpc's invocations so far, each as its argument list."""
        return [line.split() for line in self.calls_path.read_text().splitlines() if line]

    def close(self) -> None:
        self.holder.close()
        shutil.rmtree(self.root, ignore_errors=True)


def _gradio_frpc_name() -> str:
    """The file name gradio/tunneling.py gives its frpc client (BINARY_FILENAME), without importing Gradio."""
    spec = importlib.util.find_spec("gradio")
    assert spec is not None and spec.submodule_search_locations, "gradio is not installed"
    source = (Path(next(iter(spec.submodule_search_locations))) / "tunneling.py").read_text()
    version = re.search(r'^VERSION = "([^"]+)"', source, re.M)
    assert version, "gradio/tunneling.py no longer names its frpc VERSION: update the share guard"
    machine = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
    return f"frpc_{platform.system().lower()}_{machine.lower()}_v{version.group(1)}"


GUARD = ShareGuard()
GUARD.install()
atexit.register(GUARD.close)
