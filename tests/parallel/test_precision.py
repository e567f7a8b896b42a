"""Scale sites stay fp32 under FSDP2 mixed precision (spec, precision): with a bf16
MixedPrecisionPolicy on 2 gloo ranks, the s every site hands the forward pass is fp32 and equal to
the one-process value, while the matrices compute in bf16."""

import torch

from scalevec_train.model.layers import Linear
from scalevec_train.model.strategies import ScaleSite, scale_sites
from scalevec_train.model.transformer import Transformer
from scalevec_train.parallel.data_parallel import parallelize
from tests.support.helpers import make_config
from tests.support.launch import gloo_group, spawn
from tests.support.parallel import site_values
from tests.support.presets import SMALL_MODEL

OVERRIDES = ["scale=unified", *SMALL_MODEL, "model.vocab_size=128", "train.dtype=bf16",
             "device=cpu", "train.micro_batch=8"]


def tokens() -> torch.Tensor:
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))


def _rank(rank: int, world: int, store: str, out: str) -> None:
    with gloo_group(store, rank, world):
        cfg = make_config(*OVERRIDES, world_size=world)
        with torch.device("meta"):
            model = Transformer(cfg.model, cfg.scale)
        model = parallelize(model, cfg.distributed, torch.device("cpu"), seed=0,
                            dtype=cfg.train.dtype)
        site_values(model)
        seen: dict[str, object] = {}
        for path, module in model.named_modules():
            if isinstance(module, ScaleSite):
                module.register_forward_hook(
                    lambda m, args, s, path=path: seen.__setitem__(path, s.detach()))
            elif isinstance(module, Linear):
                module.register_forward_hook(
                    lambda m, args, y, path=path: seen.__setitem__(f"{path}:weight",
                                                                   m.weight.dtype))
        model(tokens()).float().sum().backward()
        params = {n: p.dtype for n, p in model.named_parameters() if "site" in n}
        torch.save({"seen": seen, "param_dtypes": params}, f"{out}/rank{rank}.pt")


def test_sites_stay_fp32_and_equal_one_process_under_bf16_fsdp(tmp_path):
    spawn(_rank, (2, str(tmp_path / "store"), str(tmp_path)))
    cfg = make_config(*OVERRIDES)
    reference = Transformer(cfg.model, cfg.scale)
    reference.init_weights(0)
    site_values(reference)
    expected = {path: site().detach() for path, site in scale_sites(reference)}
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        seen = result["seen"]
        assert seen["layers.0.attn.wq:weight"] == torch.bfloat16  # the matrices do compute in bf16
        assert set(result["param_dtypes"].values()) == {torch.float32}
        for path, s in expected.items():
            assert seen[path].dtype == torch.float32, path
            assert torch.equal(seen[path], s), path
