import pytest
import torch

from colocate_rl.types import RolloutBatch, Sample


def batch(n=2):
    s = [Sample([1, 2, 3], label="5"), Sample([4], label="6")]
    prompts = [s[0].prompt_ids] * n + [s[1].prompt_ids] * n
    resp = [[7, 8], [9], [10, 11, 12], [13]][: 2 * n]
    lps = [[-0.5] * len(r) for r in resp]
    return RolloutBatch.from_rows(prompts, resp, [s[0]] * n + [s[1]] * n, pad_id=0, response_logprobs=lps,
                                  finish_reasons=["stop", "length", "stop", "stop"][: 2 * n], n=n)


def test_from_rows_layout():
    b = batch()
    assert b.tokens.tolist()[0] == [1, 2, 3, 7, 8] and b.tokens.tolist()[2] == [4, 10, 11, 12, 0]
    assert b.loss_mask[0].tolist() == [False, False, False, True, True]
    assert b.attention_mask[2].tolist() == [True, True, True, True, False]
    assert b.rollout_logprobs[1].tolist() == [0, 0, 0, -0.5, 0]
    assert b.group_ids.tolist() == [0, 0, 1, 1] and b.n_per_group == 2
    assert b.truncated.tolist() == [False, True, False, False]


def test_select_trims_padding():
    b = batch().select(torch.tensor([1, 3]))
    assert b.tokens.shape == (2, 4) and b.samples[1].label == "6"


def test_to_moves_tensors_and_keeps_lists():
    b = batch()
    b.advantages = torch.ones(b.size)
    moved = b.to("meta")  # a device every machine has besides the CPU
    assert moved.tokens.is_meta and moved.advantages.is_meta and moved.rewards is None
    assert moved.samples is b.samples and not b.tokens.is_meta


def test_concat_renumbers_groups_and_pads():
    b = RolloutBatch.concat([batch(), batch(1)])
    assert b.group_ids.tolist() == [0, 0, 1, 1, 2, 3] and b.tokens.shape == (6, 5)


def test_shape_mismatch_names_field():
    b = batch()
    with pytest.raises(ValueError, match="RolloutBatch.loss_mask"):
        RolloutBatch(**{**b.__dict__, "loss_mask": b.loss_mask[:, :2]})


def test_weight_checksum_compare_names_the_tensor():
    from colocate_rl.weight_sync.verify import WeightMismatch, checksums, compare, tensor_checksum

    a = torch.arange(6.0).view(2, 3)
    assert tensor_checksum(a) != tensor_checksum(a.flip(0)), "a row swap changes the checksum"
    compare({"x": tensor_checksum(a)}, {"x": tensor_checksum(a.clone())})
    with pytest.raises(WeightMismatch, match="'x' differs"):
        compare({"x": tensor_checksum(a)}, {"x": tensor_checksum(a + 1e-3)})
    named = [("model.embed_tokens.weight", a), ("model.layers.0.self_attn.q_proj.weight", a)]
    assert list(checksums(iter(named), ["model.embed_tokens.weight"])) == ["model.embed_tokens.weight"]
    with pytest.raises(WeightMismatch, match="compared no tensor"):
        compare({}, {"x": 1.0})  # a check of nothing is an error, not a pass
