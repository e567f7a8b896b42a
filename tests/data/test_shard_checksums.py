"""Token shards that prove their bytes: each shard's checksum in its manifest (against xxhash run on
the file's bytes here), a flipped byte in any shard refused when a run starts (data.verify=false
reads it), `python -m scalevec_train.verify` on a cache, and shards prepared before checksums read
with a notice."""

import json
import shutil
from pathlib import Path

import pytest
import xxhash

from scalevec_train import verify as verify_cli
from scalevec_train.data.shards import MANIFEST
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.run.build import build
from tests.support.corpora import VOCAB
from tests.support.helpers import SHORT_RUN, make_config, run_main
from tests.support.presets import TINY_MODEL


@pytest.fixture
def cache(prepared, tmp_path) -> Path:
    """A copy of the module's prepared cache, to damage."""
    return Path(shutil.copytree(prepared.root.parent, tmp_path / "cache"))


def shard_files(cache: Path) -> list[Path]:
    return sorted(cache.glob("text_dir-*/*/*.bin"))


def overrides(corpus: Path, cache: Path, run_dir: Path) -> list[str]:
    """A run on the corpus whose preparation `cache` holds (the data settings of the
    `prepared` fixture)."""
    return ["data=text_dir", f"data.path={corpus}", f"data.cache_dir={cache}",
            f"model.vocab_size={VOCAB}", "data.val_fraction=0.2", "data.shard_tokens=1000",
            *TINY_MODEL, *SHORT_RUN, f"run_dir={run_dir}"]


def test_each_shards_checksum_is_in_its_manifest(prepared):
    shards = 0
    for split in ("train", "val"):
        for shard in prepared.manifest[split]["shards"]:
            file = prepared.split_dir(split) / shard["name"]
            assert shard["xxh3_64"] == xxhash.xxh3_64_hexdigest(file.read_bytes())
            shards += 1
    assert shards > 4  # several shards, written in several parts, merged


def test_a_flipped_byte_in_any_shard_is_refused_when_a_run_starts(corpus, cache, tmp_path):
    cfg = make_config(*overrides(corpus[0], cache, tmp_path / "run"))
    build(cfg)  # the undamaged shards pass
    for shard in shard_files(cache):
        original = shard.read_bytes()
        shard.write_bytes(original[:-1] + bytes([original[-1] ^ 0x01]))  # a token id changes by one
        with pytest.raises(ScalevecError) as refused:
            build(cfg)
        text = str(refused.value)
        assert text.startswith(f"{shard}: does not match the checksum its manifest recorded at "
                               "preparation"), text
        assert text.endswith(f"Fix: delete {shard.parent.parent} and prepare the data again "
                             "(python -m scalevec_train.prepare_data with this data config); or, "
                             "if you trust the shards as they are, data.verify=false."), text
        shard.write_bytes(original)
    shard = shard_files(cache)[0]
    shard.write_bytes(b"\x00" + shard.read_bytes()[1:])
    assert build(make_config(*overrides(corpus[0], cache, tmp_path / "run"),
                             "data.verify=false")).data


def test_verify_checks_every_shard_and_reads_old_manifests(corpus, cache, tmp_path, capsys):
    files = shard_files(cache)
    clean = run_main(verify_cli.main, cache)
    assert clean.returncode == 0
    assert clean.stdout.splitlines() == [f"ok            {f}" for f in files]
    damaged = files[-1]
    damaged.write_bytes(damaged.read_bytes()[:-1] + bytes([damaged.read_bytes()[-1] ^ 0x80]))
    found = run_main(verify_cli.main, cache)
    assert found.returncode == 1
    assert found.stdout.splitlines()[:-1] == clean.stdout.splitlines()[:-1]
    assert found.stdout.splitlines()[-1].startswith(f"MISMATCH      {damaged}: does not match "
                                                    "the checksum")
    # manifests written before checksums were recorded: listed as such, and read with a notice
    for manifest in cache.glob("text_dir-*/*/" + MANIFEST):
        m = json.loads(manifest.read_text())
        for shard in m["shards"]:
            del shard["xxh3_64"]
        manifest.write_text(json.dumps(m))
    old = run_main(verify_cli.main, cache)
    assert old.returncode == 0
    assert (old.stdout.splitlines()
            == [f"no checksums  {f}  (prepared before checksums were recorded)" for f in files])
    capsys.readouterr()
    build(make_config(*overrides(corpus[0], cache, tmp_path / "run")))
    notices = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert notices == [f"note: {files[0].parent.parent / split / MANIFEST} records no checksums "
                       "(prepared before scalevec recorded them): its shards are read unverified; "
                       "prepare the data again to record them." for split in ("train", "val")]
