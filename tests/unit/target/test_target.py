"""A split-placement drafter rank reads only the embedding and lm_head from the target's
safetensors, also from a sharded checkpoint such as the shipped demo target's."""

from __future__ import annotations

import pytest
import torch

from dflash.demo import DEMO_TARGET_DIR
from dflash.target.frozen import FrozenTarget


def test_embedding_and_head_from_the_sharded_demo_target_equal_the_full_load():
    assert len(list(DEMO_TARGET_DIR.glob("model-*-of-*.safetensors"))) > 1, "the demo target ships in shards"
    full = FrozenTarget.load(str(DEMO_TARGET_DIR), [1], torch.float32, torch.device("cpu"))
    embed, head = FrozenTarget.load_embedding_and_head(str(DEMO_TARGET_DIR), torch.float32, torch.device("cpu"))
    assert torch.equal(embed.weight, full.embed_tokens.weight)
    assert torch.equal(head.weight, full.lm_head.weight)


@pytest.mark.gpu
def test_features_on_a_gpu_skip_cudnn_attention_and_match_the_default_backends():
    """The training forward and HF-path decoding keep cuDNN's attention out (it plans anew for
    each new shape): in bf16 the features match HF's forward with the default backends, and no
    cuDNN attention kernel runs."""
    from torch.profiler import ProfilerActivity, profile

    from conftest import tiny_target
    from dflash.eval.speculative import greedy_decode

    target = tiny_target("qwen3", dtype=torch.bfloat16)
    target.model.cuda()
    ids = torch.randint(0, target.model.config.vocab_size, (3, 200), device="cuda")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ours = target.features(ids).features
        greedy_decode(target, ids[0, :50].tolist(), 8, set(), kind="plain")
        torch.cuda.synchronize()
    kernels = [event.name for event in prof.events() if event.device_type.name == "CUDA"]
    assert kernels and not any("cudnn" in name and "sdpa" in name for name in kernels), kernels
    with torch.no_grad():
        hidden = target.model.model(input_ids=ids, output_hidden_states=True).hidden_states
    default = torch.cat([hidden[i + 1] for i in target.layer_ids], dim=-1)
    torch.testing.assert_close(ours, default, rtol=2e-2, atol=2e-2)


def test_the_target_forward_benchmark_times_both_backend_sets_on_new_shapes():
    """dflash.benchmarks.target_forward on the demo target (CPU): each backend set gets its own
    draw of micro-batch shapes, none repeated from the other's, and a timing of each forward."""
    from dflash.benchmarks.target_forward import BACKENDS, DECODER_LAYERS, TargetForwardArgs, main, shapes

    args = TargetForwardArgs(target=str(DEMO_TARGET_DIR), max_tokens=1024, max_length=256, steps=3, warmup=1)
    first, second = shapes(args, 0), shapes(args, 1)
    assert len(first) == 4 and all(rows * length <= 1024 for rows, length in first) and first != second
    results = main(["--target", str(DEMO_TARGET_DIR), "--max-tokens", "1024", "--max-length", "256",
                    "--steps", "3", "--warmup", "1", "--dtype", "float32", "--device", "cpu"])
    for name in BACKENDS:
        assert results[name]["forwards"] == 3 and results[name]["tokens_per_second"] > 0
    decoder = results[DECODER_LAYERS]  # the same features through the fast decoder's layers: float32 rounding apart
    assert decoder["forwards"] == 3 and decoder["tokens_per_second"] > 0
    assert 0 <= decoder["largest_difference_over_largest_feature"] < 1e-5


def test_the_target_forward_benchmark_compares_length_groups_and_packed_rows_on_a_shards_micro_batches(tmp_path):
    """--shard: the sampler's micro-batches of a prepared shard, run whole, in groups and packed (CPU,
    the demo target): the same micro-batches each time, the groups compute a larger share of real
    positions, the packed rows only real ones, with the padded forward's features."""
    from dflash.benchmarks.target_forward import PACKED_ROWS, main
    from dflash.tools.data import main as data_main

    assert data_main(["prepare", "--output-dir", str(tmp_path / "run")]) == 0
    results = main(["--target", str(DEMO_TARGET_DIR), "--shard", str(tmp_path / "run" / "data" / "train"),
                    "--max-tokens", "16384", "--steps", "2", "--warmup", "1", "--dtype", "float32", "--device", "cpu"])
    whole, grouped = results["length groups 1"], results["length groups 4"]
    assert whole["micro_batches"] == grouped["micro_batches"] == 2
    assert whole["real_share_of_computed"] < grouped["real_share_of_computed"] <= 1
    assert grouped["real_tokens_per_second"] > 0 and "flash, efficient, math (training's)" not in results
    packed = results[PACKED_ROWS]
    assert packed["micro_batches"] == 2 and packed["real_share_of_computed"] == 1 and packed["real_tokens_per_second"] > 0
    assert 0 <= packed["largest_difference_over_largest_feature"] < 1e-5


def test_the_target_forward_benchmark_names_a_shard_it_cannot_read_before_loading_the_target(tmp_path, capsys):
    from dflash.benchmarks.target_forward import main

    with pytest.raises(SystemExit) as stopped:
        main(["--target", str(tmp_path / "no_target"), "--shard", str(tmp_path / "run" / "data" / "train")])
    assert stopped.value.code == 2
    assert f"{tmp_path}/run/data/train/manifest.json: no readable manifest" in capsys.readouterr().err
