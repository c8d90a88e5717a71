"""draftgraph's compiled Triton kernels in artifacts (artifacts/triton_bundle.py), on the CPU: what a build
copies out of Triton's cache is what a load puts back where Triton's JIT looks, once; an index naming a path
outside (`../`), or a file the manifest does not list, is refused before anything is written. The GPU half (real
kernels, a fresh cache, a warm start without JIT compiles) is tests/gpu/test_artifacts_cuda.py."""

import hashlib
import json
import os
import sys
import time
import types
from pathlib import Path

import pytest

pytest.importorskip("triton")

from triton.runtime.cache import get_cache_manager  # noqa: E402

from draftgraph.artifacts import triton_bundle  # noqa: E402
from draftgraph.ops import kernel_variants  # noqa: E402


def _compiled_kernel(tmp_path, name: str, payload: bytes):
    """What Triton's JIT keeps per compiled variant: its hash and its cache group (file name -> path)."""
    h = hashlib.sha256(name.encode() + payload).hexdigest()
    d = tmp_path / "build_cache" / h
    d.mkdir(parents=True)
    group = {}
    for filename, data in ((f"{name}.json", json.dumps({"name": name}).encode()), (f"{name}.cubin", payload)):
        (d / filename).write_bytes(data)
        group[filename] = str(d / filename)
    return types.SimpleNamespace(hash=h, metadata_group=group)


def test_kernels_and_launchers_round_trip(tmp_path, monkeypatch):
    a = _compiled_kernel(tmp_path, "_paged_attention_kernel", b"\x00cubin-a")
    b = _compiled_kernel(tmp_path, "_write", b"\x01cubin-b")
    pending = object()  # a compile still in flight has no cache group: skipped
    fn = types.SimpleNamespace(device_caches={0: ({"k1": a, "k2": b, "k3": pending}, {}, None, None, None)})
    monkeypatch.setattr(triton_bundle, "jit_functions", lambda: {"draftgraph.ops.x._kernels": fn})
    build_cache = tmp_path / "triton_build"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(build_cache))
    since = time.time() - 1
    old = build_cache / "OLDLAUNCHER"  # built before this engine: not bundled
    old.mkdir(parents=True)
    (old / "__triton_launcher.so").write_bytes(b"old")
    os.utime(old / "__triton_launcher.so", (since - 100, since - 100))
    new = build_cache / "NEWLAUNCHER"
    new.mkdir()
    (new / "__triton_launcher.so").write_bytes(b"\x7fELF launcher")

    out = tmp_path / "art"
    out.mkdir()
    index = triton_bundle.save_kernels(out, since)
    assert set(index["kernels"]) == {a.hash, b.hash}
    assert index["kernels"][a.hash] == {
        "kernel": "draftgraph.ops.x._kernels",
        "metadata": "_paged_attention_kernel.json",
        "files": ["_paged_attention_kernel.cubin", "_paged_attention_kernel.json"],
    }
    assert index["launchers"] == {"NEWLAUNCHER": "__triton_launcher.so"}
    assert json.loads((out / "triton" / "index.json").read_text()) == index

    fresh = tmp_path / "triton_fresh"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(fresh))
    files = {f.relative_to(out).as_posix(): f.read_bytes() for f in out.rglob("*") if f.is_file()}
    triton_bundle.check_index(index, files)
    assert triton_bundle.restore_kernels(index, files, str(fresh)) == 3  # two kernels and one launcher
    for k, name in ((a, "_paged_attention_kernel"), (b, "_write")):
        group = get_cache_manager(k.hash).get_group(f"{name}.json")  # where the JIT looks
        assert group is not None and set(group) == set(k.metadata_group)
        for filename, path in group.items():
            assert Path(path).read_bytes() == Path(k.metadata_group[filename]).read_bytes()
    assert (fresh / "NEWLAUNCHER" / "__triton_launcher.so").read_bytes() == b"\x7fELF launcher"
    assert triton_bundle.restore_kernels(index, files, str(fresh)) == 0  # already there: nothing rewritten
    with pytest.raises(RuntimeError, match="not the private"):  # only ever into the cache Triton reads
        triton_bundle.restore_kernels(index, files, str(tmp_path / "elsewhere"))


def test_no_kernels_no_bundle(tmp_path, monkeypatch):
    monkeypatch.setattr(triton_bundle, "jit_functions", dict)
    assert triton_bundle.save_kernels(tmp_path, None) == {"kernels": {}, "launchers": {}}
    assert not (tmp_path / "triton").exists()  # a CPU artifact has no triton/ directory
    assert triton_bundle.restore_kernels({"kernels": {}, "launchers": {}}, {}, str(tmp_path)) == 0
    # Triton is not a runtime dependency: without it there is no cache directory, and a bundle is still empty
    monkeypatch.setitem(sys.modules, "triton", None)
    assert triton_bundle._cache_root() is None
    assert triton_bundle.save_kernels(tmp_path, 0.0) == {"kernels": {}, "launchers": {}}


def test_compiled_variants_counts_every_device(monkeypatch):
    fn = types.SimpleNamespace(device_caches={0: ({"a": 1, "b": 2}, {}), 1: ({"c": 3}, {})})
    idle = types.SimpleNamespace(device_caches={})
    monkeypatch.setattr(kernel_variants, "jit_functions", lambda: {"m.k": fn, "m.helper": idle})
    assert kernel_variants.compiled_variants() == {"m.k": 3}


@pytest.mark.parametrize(
    "index",
    [
        {"launchers": {"../../.local/lib/python3.11/site-packages": "__triton_launcher.so"}},
        {"launchers": {"k": "../evil.pth"}},
        {"launchers": {"/abs": "__triton_launcher.so"}},
        {"launchers": {"k": "evil.pth"}},  # not a launcher module
        {"kernels": {"..": {"metadata": "a.json", "files": ["a.json"]}}},
        {"kernels": {"h": {"metadata": "a.json", "files": ["a.json", "../../x"]}}},
        {"kernels": {"h": {"metadata": "b.json", "files": ["a.json"]}}},
        {"kernels": {"h": {"metadata": "a.json", "files": ["a.json"]}}},  # triton/h/a.json is not listed
        {"kernels": []},
    ],
)
def test_an_index_naming_anything_but_listed_plain_names_is_refused(index):
    with pytest.raises(ValueError, match="triton/index.json"):
        triton_bundle.check_index(index, {"triton/k/__triton_launcher.so": b""})
