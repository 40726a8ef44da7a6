"""The NeMo-RL v0.7.0 source the tests run, on any machine: the vendored archive where it is
(../shared/vendor/), else GitHub's archive of the v0.7.0 commit, checked file by file against
the vendored tree's digest. GitHub is not reachable from CI, so the download is served here
from a local HTTP server in GitHub's archive layout (top folder ``RL-<commit>/``, the whole
repository), built from the same files."""

from __future__ import annotations

import functools
import http.server
import tarfile
import threading
from pathlib import Path

import pytest

import tests.conftest as C


def github_like_archive(src: Path, path: Path, *, tamper: bool = False) -> Path:
    """``src``'s files under ``RL-<commit>/`` plus files outside the vendored paths."""
    top = f"RL-{C.NEMO_RL_COMMIT}"
    extra = path.parent / "README.md"
    extra.write_text("# NeMo RL\n")
    with tarfile.open(path, "w:gz") as tar:
        tar.add(src, arcname=top)
        tar.add(extra, arcname=f"{top}/README.md")  # not a vendored path: left out
        tar.add(extra, arcname=f"{top}/3rdparty/Megatron-LM/README.md")
        if tamper:
            changed = path.parent / "__init__.py"
            changed.write_text((src / "nemo_rl" / "__init__.py").read_text() + "\n# changed\n")
            tar.add(changed, arcname=f"{top}/nemo_rl/__init__.py")  # the later member wins
    return path


@pytest.fixture
def served(tmp_path: Path):
    """``served(file)``: an http:// address for ``file`` on 127.0.0.1, for this test."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield lambda file: f"http://127.0.0.1:{server.server_port}/{Path(file).relative_to(tmp_path)}"
    server.shutdown()


def test_without_the_vendored_archive_the_source_is_downloaded_and_checked(
    nemo_rl_src: Path, served, tmp_path: Path, monkeypatch
) -> None:
    url = served(github_like_archive(nemo_rl_src, tmp_path / "RL.tar.gz"))
    monkeypatch.setattr(C, "VENDORED_NEMO_RL", tmp_path / "absent" / "nemo-rl-v0.7.0.tar.gz")
    monkeypatch.setenv("ALIGNPIPE_UPSTREAM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("ALIGNPIPE_NEMO_RL_URL", url)
    monkeypatch.delenv("NEMO_RL_SRC", raising=False)
    src = C.extract_nemo_rl_source()
    assert src.is_relative_to(tmp_path / "cache") and (src / "examples" / "run_grpo.py").is_file()
    assert C.tree_digest(src) == C.NEMO_RL_TREE_SHA256 == C.tree_digest(nemo_rl_src)
    assert not (src / "README.md").exists() and not (src / "3rdparty").exists()
    assert C.extract_nemo_rl_source() == src  # cached: a second call downloads nothing
    assert not list((tmp_path / "cache").glob(".extract-*"))


def test_a_download_with_other_files_is_refused(nemo_rl_src: Path, served, tmp_path: Path) -> None:
    url = served(github_like_archive(nemo_rl_src, tmp_path / "RL.tar.gz", tamper=True))
    (tmp_path / "into").mkdir()
    with pytest.raises(AssertionError, match=f"not v0.7.0's {C.NEMO_RL_TREE_SHA256}"):
        C.fetch_nemo_rl_source(tmp_path / "into", url)


def test_an_unreachable_source_fails_naming_how_to_get_it(tmp_path: Path) -> None:
    (tmp_path / "into").mkdir()
    with pytest.raises(AssertionError) as info:
        C.fetch_nemo_rl_source(tmp_path / "into", "http://127.0.0.1:9/RL.tar.gz")  # discard port: refused
    assert "NEMO_RL_SRC" in str(info.value) and C.NEMO_RL_COMMIT in str(info.value)
