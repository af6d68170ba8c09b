"""A corpus of malformed and hostile checkpoints registered through the real store process: each
is refused with its status code and a message naming the cause, nothing of it is stored, and
the store keeps serving good adapters afterwards."""

import json
import os
import pickle
import shutil
import struct
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.pb.loramux.store.v1 import adapter_store_pb2 as pb
from shared.pb.loramux.store.v1 import adapter_store_pb2_grpc as pb_grpc
from tests.adapter_store.conftest import AUTH, StoreProcess, store_flags, upload_folder

PREFIX = "base_model.model.model.layers.0.self_attn"
EMBED_LORA = "base_model.model.model.embed_tokens.lora_A.weight"
WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"
INVALID, PRECONDITION, DENIED = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED,
)


def _config(**changes):
    def edit(folder: Path) -> None:
        cfg = json.loads((folder / CONFIG).read_text())
        cfg.update(changes)
        (folder / CONFIG).write_text(json.dumps(cfg))

    return edit


def _tensors(change):
    def edit(folder: Path) -> None:
        tensors = load_file(folder / WEIGHTS)
        change(tensors)
        save_file(tensors, folder / WEIGHTS)

    return edit


def _set(key: str, value):
    return _tensors(lambda t: t.__setitem__(f"{PREFIX}.{key}", value(t[f"{PREFIX}.{key}"])))


def _poison(t: torch.Tensor, value: float) -> torch.Tensor:
    t = t.clone()
    t[0, 0] = value
    return t


def _raw(write):
    def edit(folder: Path) -> None:
        (folder / WEIGHTS).write_bytes(write((folder / WEIGHTS).read_bytes()))

    return edit


def _nested_header(data: bytes, depth: int) -> bytes:
    """A header whose metadata nests `depth` lists deep, past any JSON reader's recursion limit."""
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    new = json.dumps(header).encode()[:-1] + b', "deep": ' + b"[" * depth + b"]" * depth + b"}"
    return struct.pack("<Q", len(new)) + new + data[8 + size :]


def _header_claims_more(data: bytes) -> bytes:
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    name = next(k for k in header if k != "__metadata__")
    start, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [start, end + 10_000]
    new = json.dumps(header).encode()
    return struct.pack("<Q", len(new)) + new + data[8 + size :]


class _PickleBomb:
    """Unpickling this would create the file at `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _pickle_only(marker: Path):
    def edit(folder: Path) -> None:
        (folder / WEIGHTS).unlink()
        (folder / "adapter_model.bin").write_bytes(pickle.dumps(_PickleBomb(marker)))

    return edit


def _symlinked_weights(folder: Path) -> None:
    (folder / WEIGHTS).unlink()
    os.symlink("/etc/passwd", folder / WEIGHTS)


def _oversize(folder: Path) -> None:
    with open(folder / WEIGHTS, "ab") as f:
        f.truncate(3 << 20)  # the store under test refuses files over 2 MiB


# name -> (edit of a good rank-4 q/v adapter, expected code, text the message must contain)
CORPUS = {
    "dora": (_config(use_dora=True), INVALID, "DoRA"),
    "modules-to-save": (_config(modules_to_save=["lm_head"]), INVALID, "lack lm_head.weight"),
    "trained-bias": (_config(bias="all"), INVALID, "bias='all'"),
    "not-lora": (_config(peft_type="PREFIX_TUNING"), INVALID, "PREFIX_TUNING"),
    "rank-above-max": (_config(r=32, lora_alpha=64), INVALID, "r=32"),
    "config-rank-mismatch": (_config(r=8), INVALID, "says r=8"),
    "alpha-not-number": (_config(lora_alpha="big"), INVALID, "lora_alpha"),
    "unknown-target": (_config(target_modules=["q_proj", "c_attn"]), PRECONDITION, "c_attn"),
    "lm-head-target": (
        _config(target_modules=["q_proj", "v_proj", "lm_head"]),
        INVALID,
        "lack lm_head.lora_A",
    ),
    "rank-pattern-not-a-rank": (_config(rank_pattern={"q_proj": "x"}), INVALID, "rank_pattern"),
    "alpha-pattern-not-a-number": (_config(alpha_pattern={"q_proj": "x"}), INVALID, "alpha_pattern"),
    "pattern-not-a-regex": (_config(rank_pattern={"(": 4}), INVALID, "is not a regex"),
    "target-regex-not-a-regex": (_config(target_modules="("), INVALID, "is not a regex"),
    # Python's re backtracks through every split of a module name: minutes, before the bound
    "pattern-backtracking": (_config(rank_pattern={"(.|.)*x": 4}), INVALID, "took longer than"),
    "target-regex-backtracking": (_config(target_modules="(.|.)*x"), INVALID, "took longer than"),
    "config-not-json": (lambda f: (f / CONFIG).write_text("{r: 4"), INVALID, "not valid JSON"),
    "config-a-list": (lambda f: (f / CONFIG).write_text("[4]"), INVALID, "JSON object"),
    "config-nested-deep": (  # past Python's JSON reader's recursion limit
        lambda f: (f / CONFIG).write_text("[" * 100_000 + "]" * 100_000),
        INVALID,
        "not valid JSON",
    ),
    "config-missing": (lambda f: (f / CONFIG).unlink(), INVALID, CONFIG),
    "shape-mismatch": (_set("q_proj.lora_A.weight", lambda t: torch.zeros(4, 65)), INVALID, "(4, 65)"),
    "nan": (_set("q_proj.lora_B.weight", lambda t: _poison(t, float("nan"))), INVALID, "NaN"),
    "inf": (_set("v_proj.lora_A.weight", lambda t: _poison(t, float("inf"))), INVALID, "Inf"),
    "int-dtype": (_set("q_proj.lora_A.weight", lambda t: t.to(torch.int32)), INVALID, "int32"),
    "float64": (_set("q_proj.lora_A.weight", lambda t: t.double()), INVALID, "float64"),
    "unpaired": (_tensors(lambda t: t.pop(f"{PREFIX}.v_proj.lora_B.weight")), INVALID, "lora_B"),
    "foreign-tensor": (
        _tensors(lambda t: t.__setitem__(EMBED_LORA, torch.ones(4, 9))),
        INVALID,
        "embed_tokens",
    ),
    "layer-past-model": (
        _tensors(
            lambda t: t.update(
                {k.replace("layers.0.", "layers.7."): v.clone() for k, v in t.items() if "layers.0." in k}
            )
        ),
        PRECONDITION,
        "layer 7",
    ),
    "no-tensors": (lambda f: save_file({}, f / WEIGHTS), INVALID, "no LoRA weights"),
    "truncated": (_raw(lambda b: b[: len(b) - 100]), INVALID, "safetensors"),
    "header-claims-more": (_raw(_header_claims_more), INVALID, "safetensors"),
    "header-length-huge": (_raw(lambda b: struct.pack("<Q", 1 << 40) + b[8:]), INVALID, "safetensors"),
    "header-nested-deep": (_raw(lambda b: _nested_header(b, 100_000)), INVALID, "safetensors"),
    "garbage": (_raw(lambda b: os.urandom(2048)), INVALID, "safetensors"),
    "empty-weights": (_raw(lambda b: b""), INVALID, "safetensors"),
    "oversize": (_oversize, INVALID, "bytes"),
    "symlink-escape": (_symlinked_weights, DENIED, "outside"),
}


@pytest.fixture(scope="module")
def corpus(sources_root, tiny_adapters, tmp_path_factory) -> dict[str, Path]:
    folders = {}
    for name, (edit, _, _) in CORPUS.items():
        folder = Path(shutil.copytree(tiny_adapters["llama"]["qv4"], sources_root / "corpus" / name))
        edit(folder)
        folders[name] = folder
    return folders


@pytest.fixture(scope="module")
def small_store(tmp_path_factory, sources_root, s3_endpoint, tiny_models):
    flags = store_flags(sources_root, s3_endpoint, tiny_models, "--max-adapter-bytes", str(2 << 20))
    process = StoreProcess(tmp_path_factory.mktemp("corpus-store"), flags).start()
    yield process
    assert process.stop() == 0


def _register(stub, adapter_id: str, uri: str):
    request = pb.RegisterAdapterRequest(adapter_id=adapter_id, source_uri=uri)
    return stub.RegisterAdapter(request, metadata=AUTH)


def test_corpus_is_large_enough():
    assert len(CORPUS) >= 20


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_hostile_checkpoint_is_refused_from_disk(small_store, corpus, name):
    _, code, named = CORPUS[name]
    with grpc.insecure_channel(small_store.address) as channel:
        stub = pb_grpc.AdapterStoreStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            _register(stub, name, f"file://{corpus[name]}")
        assert e.value.code() == code, e.value.details()
        assert named in e.value.details() and "adapter" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            stub.GetAdapter(pb.GetAdapterRequest(adapter_id=name), metadata=AUTH)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_pickle_bomb_is_refused_from_disk_and_s3_and_never_runs(
    small_store, sources_root, s3_endpoint, tmp_path, tiny_adapters
):
    marker = tmp_path / "pwned"
    folder = Path(shutil.copytree(tiny_adapters["llama"]["qv4"], sources_root / "pickle-bomb"))
    _pickle_only(marker)(folder)
    with grpc.insecure_channel(small_store.address) as channel:
        stub = pb_grpc.AdapterStoreStub(channel)
        for uri in (f"file://{folder}", upload_folder(s3_endpoint, folder, "bomb")):
            with pytest.raises(grpc.RpcError) as e:
                _register(stub, "bomb", uri)
            assert e.value.code() == INVALID
            assert "adapter_model.bin is a pickle checkpoint" in e.value.details()
    assert not marker.exists()


def test_store_still_serves_after_the_corpus(small_store, sources_root, corpus):
    with grpc.insecure_channel(small_store.address) as channel:
        stub = pb_grpc.AdapterStoreStub(channel)
        for name in CORPUS:  # all refused again, in one go, before the good one
            with pytest.raises(grpc.RpcError):
                _register(stub, name, f"file://{corpus[name]}")
        good = _register(stub, "good-after-corpus", f"file://{sources_root / 'qv4'}")
        chunks = [r.chunk for r in stub.FetchAdapter(pb.FetchAdapterRequest(adapter_id=good.adapter_id))][1:]
        assert sum(len(c) for c in chunks) == good.size_bytes
        listed = stub.ListAdapters(pb.ListAdaptersRequest(), metadata=AUTH).adapters
        assert [a.adapter_id for a in listed] == ["good-after-corpus"]
