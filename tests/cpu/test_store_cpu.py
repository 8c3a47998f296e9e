"""The kernel store and its sets on disk, without CuTe DSL or a GPU: kernel sets made here stand
in for compiled ones (their cubin is an ELF header of machine EM_CUDA and no code).

* A damaged set (a sidecar that is not JSON, is half-written or lacks a field; a cubin that is
  missing or not a CUDA cubin) is never used. Without CuTe DSL the store raises an error that
  names the file and the command that rebuilds it; with it, the store warns once, naming the
  file, and builds the kernel into its cache.
* A set is complete once its sidecar exists: a save writes each file whole, the sidecar last,
  and takes an old sidecar away first, so an interrupted save leaves no set, never a mixed one.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import warnings

import pytest

from jax_moe_publish import _abi, tuning
from jax_moe_publish.aot import __main__ as aot_cli
from jax_moe_publish.aot import artifact, presets, store
from jax_moe_publish.aot import compile as aot_compile
from jax_moe_publish.aot.compile import call_record
from jax_moe_publish.experts_config import ExpertsConfig

CONFIG = tuning.kernel_config(tuning.Problem(512, 2), tp=2, m=None)


EXPERTS = ExpertsConfig.for_shape(hidden=7168, intermediate=256, experts=256, top_k=8, m=256)


@pytest.mark.parametrize("config", [CONFIG, CONFIG.replace(keep_own_partial=True), EXPERTS,
                                    EXPERTS.replace(gate_up_token_tiles=3), EXPERTS.replace(gate_up_column_blocks=2)],
                         ids=["publish", "publish-own-partial", "experts", "experts-gate-up-tiles",
                              "experts-column-blocks"])
def test_the_build_command_parses_back_to_its_config(config):
    """The command a missing set's error names gives the CLI that config again, a field left
    None (it follows another) included."""
    args = aot_cli._parser().parse_args(shlex.split(store.build_command(config))[3:])
    assert aot_cli._configs(args) == [config]


def test_an_experts_model_builds_the_sets_a_preset_would_hold_at_its_tp_sizes():
    """``--experts-model`` gives, per TP size, what ``presets.experts`` gives the shape: among
    them the op's config for every m at each shard, and prepared with the shared expert."""
    args = aot_cli._parser().parse_args(shlex.split(
        "build --out DIR --experts-model 7168,2048,384,8 --experts-model 2048,768,64,4,shared --experts-tp 4 8"))
    configs = aot_cli._configs(args)
    assert configs == presets.experts([(7168, 2048, 384, 8, False), (2048, 768, 64, 4, True)], tps=(4, 8))
    for m in (1, 9, 64, 256, 1024, None):
        for tp in (4, 8):
            assert ExpertsConfig.for_shape(hidden=7168, intermediate=2048 // tp, experts=384, top_k=8, m=m) in configs
            shared = ExpertsConfig.for_shape(hidden=2048, intermediate=768 // tp, experts=64, top_k=4, m=m,
                                             shared_expert=True)
            assert shared.replace(tiled_weights=True) in configs
    assert {(c.hidden, c.intermediate) for c in configs} == {(7168, 512), (7168, 256), (2048, 192), (2048, 96)}
    default = aot_cli._configs(aot_cli._parser().parse_args(shlex.split("build --out DIR --experts-model 512,128,8,2")))
    assert {c.intermediate for c in default} == {128, 64, 32, 16}  # tp 1, 2, 4 and 8


@pytest.mark.parametrize("flags, words", [
    ("--experts-model 7168,2048,384", "argument --experts-model: '7168,2048,384': expected HIDDEN,INTERMEDIATE"),
    ("--experts-model 7168,2048,384,8,sharde", "then ',shared' for a shared expert"),
    ("--experts-model 7168,0,384,8", "(positive ints, the model's unsharded intermediate)"),
])
def test_a_malformed_experts_model_is_refused_by_name(capsys, flags, words):
    with pytest.raises(SystemExit) as raised:
        aot_cli._parser().parse_args(shlex.split(f"build --out DIR {flags}"))
    assert raised.value.code == 2 and words in capsys.readouterr().err


@pytest.mark.parametrize("flags, words", [
    ("--experts-model 7168,2048,384,8 --experts-tp 3 8",
     "--experts-tp 3: expected TP sizes that divide the intermediate of --experts-model 7168,2048,384,8 evenly"),
    ("--experts-model 7160,2048,384,8 --experts-tp 2",
     "--experts-model 7160,2048,384,8 at tp 2 (intermediate 1024 per rank): ExpertsConfig.hidden=7160: expected"),
])
def test_an_experts_model_the_kernels_cannot_shard_is_refused_by_name(flags, words):
    with pytest.raises(SystemExit, match=re.escape(words)):
        aot_cli._configs(aot_cli._parser().parse_args(shlex.split(f"build --out DIR {flags}")))


def elf_header(machine: int = 190) -> bytes:  # EM_CUDA
    """The 64-byte header of a little-endian ELF64 file of ``machine``."""
    ident = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    return ident + (2).to_bytes(2, "little") + machine.to_bytes(2, "little") + bytes(44)


def kernel_set(config=CONFIG, code: bytes = b"") -> artifact.KernelArtifact:
    """A set of ``config`` as the compile step would write it, its cubin a header and ``code``."""
    kernels = []
    for role in _abi.call_roles(config):
        contract = _abi.ALL_ROLES[role]
        kernels.append({
            "role": role, "symbol": f"kernel_cutlass_{role}_jax_moe_publish", "params": list(contract.params),
            "param_types": [_abi.ALL_VALUES[name] for name in contract.params], "block": config.threads, "smem": 0,
            "ctas_per_row": config.ctas_per_row, "rows": "m", "waves": config.waves,
            "persistent": contract.persistent, "cluster": config.ctas_per_row if contract.clustered else 1,
        })
    metadata = {
        "sidecar_version": artifact.SIDECAR_VERSION, "key": config.key, "op": config.op, "config": config.to_dict(),
        "arch": config.arch, "dsl_version": artifact.dsl_version(), "source_fingerprint": artifact.source_fingerprint(),
        "call": call_record(config), "kernels": kernels,
    }
    return artifact.KernelArtifact(cubin=elf_header() + code, ptx="// ptx", metadata=metadata)


def sidecar_text(damage):
    """A sidecar's text with ``damage`` applied to its metadata (a callable) or replacing it (text)."""
    metadata = kernel_set().metadata
    if callable(damage):
        return json.dumps(damage(metadata))
    return damage


def without(name):
    return lambda metadata: {k: v for k, v in metadata.items() if k != name}


def first_kernel_without(name):
    def change(metadata):
        metadata["kernels"][0].pop(name)
        return metadata

    return change


SIDECAR_DAMAGE = [
    ("garbage", "\x00\x13 not json", "is not valid JSON"),
    ("half-written", json.dumps(kernel_set().metadata)[:200], "is not valid JSON"),
    ("empty", "", "is not valid JSON"),
    ("a list", "[1, 2]", "holds a JSON list, not the sidecar's object"),
    ("no kernels", without("kernels"), "lacks the field(s) ['kernels']"),
    ("no call", without("call"), "lacks the field(s) ['call']"),
    ("kernels empty", lambda metadata: {**metadata, "kernels": []}, "has kernels of an empty list"),
    ("kernels a dict", lambda metadata: {**metadata, "kernels": {}}, "has kernels of a dict"),
    ("kernel without role", first_kernel_without("role"), "kernels[0] lacks the field(s) ['role']"),
    ("config a string", lambda metadata: {**metadata, "config": "oneshot"}, "has a config of type str"),
]
CUBIN_DAMAGE = [
    ("missing", None, "is missing, but its sidecar"),
    ("empty", b"", "is not a CUDA cubin: it is empty"),
    ("PTX", b"//\n// Generated by NVIDIA NVVM Compiler\n.version 8.7\n", "not with the ELF magic"),
    ("truncated", elf_header()[:30], "fewer than an ELF64 header's 64: it is truncated"),
    ("x86-64", elf_header(machine=62) + b"code", "its ELF machine is 62, not EM_CUDA (190)"),
]
DAMAGE = ([pytest.param("json", text, words, id=f"sidecar {case}") for case, text, words in SIDECAR_DAMAGE]
          + [pytest.param("cubin", data, words, id=f"cubin {case}") for case, data, words in CUBIN_DAMAGE])


def damage_set(folder, part, change):
    """Save a good set of CONFIG into ``folder``, then damage its sidecar or its cubin; the damaged file."""
    kernel_set().save(folder)
    path = folder / f"{CONFIG.key}.{part}"
    if part == "json":
        path.write_text(sidecar_text(change))
    elif change is None:
        path.unlink()
    else:
        path.write_bytes(change)
    return path


@pytest.fixture
def no_dsl(monkeypatch):
    monkeypatch.setattr(store, "dsl_available", lambda: False)


@pytest.fixture
def builds(monkeypatch) -> list:
    """CuTe DSL stood in for: the configs the store compiles, each built as `kernel_set`."""
    built = []

    def compile_config(config):
        built.append(config)
        return kernel_set(config, code=b"built")

    monkeypatch.setattr(store, "dsl_available", lambda: True)
    monkeypatch.setattr(aot_compile, "compile_config", compile_config)
    return built


def new_store(tmp_path, *folders) -> store.KernelStore:
    return store.KernelStore(cache_dir=tmp_path / "cache", prebuilt_dirs=list(folders))


@pytest.mark.parametrize("part,change,words", DAMAGE)
def test_loading_a_damaged_set_names_the_file(tmp_path, part, change, words):
    path = damage_set(tmp_path, part, change)
    with pytest.raises(artifact.DamagedKernelError) as raised:
        artifact.KernelArtifact.load(tmp_path, CONFIG.key)
    assert str(raised.value).startswith(f"{path}: ")
    assert words in str(raised.value)
    assert raised.value.path == path


@pytest.mark.parametrize("config", [CONFIG, EXPERTS], ids=["publish", "experts"])
def test_without_dsl_a_missing_set_names_its_build_command(tmp_path, no_dsl, config):
    """And for the experts op, whose sets change with m, the command of every set of a model."""
    with pytest.raises(store.MissingKernelError) as raised:
        new_store(tmp_path, tmp_path / "prebuilt").get(config)
    message = str(raised.value)
    assert store.build_command(config) in message and store.KERNEL_DIR_ENV in message
    assert ("--experts-model HIDDEN,INTERMEDIATE,EXPERTS,TOP_K" in message) == (config is EXPERTS)


@pytest.mark.parametrize("part,change,words", DAMAGE)
def test_without_dsl_a_damaged_prebuilt_set_says_how_to_rebuild_it(tmp_path, no_dsl, part, change, words):
    path = damage_set(tmp_path / "prebuilt", part, change)
    with pytest.raises(store.MissingKernelError) as raised:
        new_store(tmp_path, tmp_path / "prebuilt").get(CONFIG)
    message = str(raised.value)
    assert f"kernel set {CONFIG.key} in {tmp_path / 'prebuilt'} is damaged: {path}: " in message
    assert words in message
    assert "CuTe DSL is not installed" in message
    assert store.build_command(CONFIG, str(tmp_path / "prebuilt")) in message


@pytest.mark.parametrize("part,change,words", DAMAGE)
def test_with_dsl_a_damaged_prebuilt_set_is_reported_once_and_built(tmp_path, builds, part, change, words):
    path = damage_set(tmp_path / "prebuilt", part, change)
    kernels = new_store(tmp_path, tmp_path / "prebuilt")
    with pytest.warns(RuntimeWarning) as warned:
        built = kernels.get(CONFIG)
    (warning,) = warned
    message = str(warning.message)
    assert f"kernel set {CONFIG.key} in {tmp_path / 'prebuilt'} is damaged, so it is not used: {path}: " in message
    assert words in message and f"building it into the cache {kernels.cache_dir}" in message
    assert store.build_command(CONFIG, str(tmp_path / "prebuilt")) in message
    assert built.cubin.endswith(b"built") and builds == [CONFIG]
    assert kernels.stats == store.StoreStats(compiles=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels.get(CONFIG) is built  # once: from memory, no second warning
    # Another process finds the built set in the cache, and is told about the folder too.
    again = new_store(tmp_path, tmp_path / "prebuilt")
    with pytest.warns(RuntimeWarning, match="using the set built in the cache"):
        assert again.get(CONFIG).cubin == built.cubin
    assert again.stats == store.StoreStats(disk_hits=1) and builds == [CONFIG]


def test_a_damaged_set_before_a_good_one_is_reported_and_passed_over(tmp_path, no_dsl):
    path = damage_set(tmp_path / "damaged", "json", "{")
    kernel_set(code=b"good").save(tmp_path / "good")
    kernels = new_store(tmp_path, tmp_path / "damaged", tmp_path / "good")
    with pytest.warns(RuntimeWarning, match=f"{path}: is not valid JSON.*; using the set in {tmp_path / 'good'}"):
        assert kernels.get(CONFIG).cubin.endswith(b"good")
    assert kernels.stats == store.StoreStats(prebuilt_hits=1)


def test_with_dsl_a_damaged_cached_set_is_built_over(tmp_path, builds):
    kernels = new_store(tmp_path)
    path = damage_set(kernels.cache_dir, "cubin", b"")
    with pytest.warns(RuntimeWarning, match=f"{path}: is not a CUDA cubin: it is empty; building it into the cache"):
        kernels.get(CONFIG)
    assert builds == [CONFIG]
    assert artifact.KernelArtifact.load(kernels.cache_dir, CONFIG.key).cubin.endswith(b"built")


def test_a_set_is_written_whole(tmp_path):
    path = kernel_set().save(tmp_path)
    assert path == tmp_path / f"{CONFIG.key}.json"
    assert sorted(os.listdir(tmp_path)) == [f"{CONFIG.key}.{suffix}" for suffix in ("cubin", "json", "ptx")]
    loaded = artifact.KernelArtifact.load(tmp_path, CONFIG.key)
    assert loaded == kernel_set()


def test_an_interrupted_save_over_a_set_leaves_no_set(tmp_path, monkeypatch):
    """Interrupted before the new sidecar lands: the new cubin is in place, so the old sidecar
    must be gone too (it would describe another build), and no temporary file is left."""
    kernel_set(code=b"old").save(tmp_path)
    replace = os.replace

    def interrupted(source, target):
        if str(target).endswith(".json"):
            raise KeyboardInterrupt
        replace(source, target)

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        kernel_set(code=b"new").save(tmp_path)
    monkeypatch.setattr(os, "replace", replace)
    assert artifact.KernelArtifact.load(tmp_path, CONFIG.key) is None
    assert sorted(os.listdir(tmp_path)) == [f"{CONFIG.key}.cubin", f"{CONFIG.key}.ptx"]
    kernel_set(code=b"new").save(tmp_path)  # the next save completes it
    assert artifact.KernelArtifact.load(tmp_path, CONFIG.key).cubin.endswith(b"new")


def test_a_sidecar_of_another_version_is_stale_not_damaged(tmp_path, no_dsl):
    """A sidecar of another version may have other fields: the store says to rebuild it, as for
    any stale set, not that it is damaged."""
    kernel_set().save(tmp_path / "prebuilt")
    (tmp_path / "prebuilt" / f"{CONFIG.key}.json").write_text(json.dumps({"sidecar_version": 1, "key": CONFIG.key}))
    assert artifact.KernelArtifact.load(tmp_path / "prebuilt", CONFIG.key).is_current is False
    with pytest.raises(store.MissingKernelError, match="was built from other kernel sources or by another sidecar"):
        new_store(tmp_path, tmp_path / "prebuilt").get(CONFIG)
