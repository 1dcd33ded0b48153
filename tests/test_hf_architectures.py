"""Other HF decoder-only models on 2 ranks: each either matches single-device eager (loss and every
gradient) with its graph sharded, or is refused with a reason and still matches (runs unsharded).
Never a wrong result."""
import functools

import pytest

import model_zoo as zoo
from burstc.testing import WorkerPool, assert_equivalent

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.multirank, pytest.mark.slow]

# architecture -> whether burstc shards it today (a regression test both ways)
ARCHITECTURES = {
    "LlamaConfig": True, "MistralConfig": True, "Qwen2Config": True, "Qwen3Config": True, "GemmaConfig": True,
    "Phi3Config": True, "GPTNeoXConfig": True, "StableLmConfig": True, "OlmoConfig": True, "Olmo2Config": True,
    "OPTConfig": True, "FalconConfig": True, "GPT2Config": True,
    # the logits are scaled between the head and the loss (no LM-head fusion): sharded with a plain
    # cross_entropy on each rank's rows
    "CohereConfig": True, "GraniteConfig": True,
    # refused today, with its reason: Gemma-2 (eager attention with soft-capped scores)
    "Gemma2Config": False,
}


@pytest.fixture(scope="module")
def workers():
    with WorkerPool() as pool:
        yield pool


@pytest.mark.parametrize("config_name", sorted(ARCHITECTURES))
def test_architecture_is_exact_or_refused(workers, config_name):
    if not hasattr(transformers, config_name):
        pytest.skip(f"transformers has no {config_name}")
    results = assert_equivalent(functools.partial(zoo.hf_arch, config_name), zoo.hf_arch_inputs,
                                zoo.hf_loss_no_cache, world_size=2, group=workers.get(2), backend="aot_eager",
                                expect_sharded=ARCHITECTURES[config_name], timeout=300)
    kinds = [k for k, _ in results[0]["rewrites"]]
    if ARCHITECTURES[config_name]:
        assert "shard" in kinds and "attention" in kinds
    else:
        assert "shard" not in kinds
        assert any(kind == "shard" for kind, _ in results[0]["skipped"]) or not kinds
