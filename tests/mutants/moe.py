"""The mutants of src/zerostack/moe/ (the gate: tests/mutants/__init__.py)."""

from . import Mutant

MUTANTS: list[Mutant] = [
    Mutant(
        "top-2's second choices do not queue behind the first choices",
        "moe/sharded_moe.py",
        "locations2 = torch.cumsum(mask2, dim=0) - 1 + torch.sum(mask1, dim=0, keepdim=True)",
        "locations2 = torch.cumsum(mask2, dim=0) - 1",
        ("tests/test_moe.py::test_gates_route_drop_and_weigh_as_the_spec[2-0.5-1-True]",),
    ),
    Mutant(
        "top-2's capacity is not doubled",
        "moe/sharded_moe.py",
        "_capacity(num_tokens, num_experts, 2 * capacity_factor, min_capacity)",
        "_capacity(num_tokens, num_experts, capacity_factor, min_capacity)",
        ("tests/test_moe.py::test_gates_route_drop_and_weigh_as_the_spec[2-4.0-4-True]",),
    ),
    Mutant(
        "top-2's weights are not renormalised over the kept choices",
        "moe/sharded_moe.py",
        "gates1 = (gates1_s / denom_s)[:, None] * mask1_f",
        "gates1 = gates1_s[:, None] * mask1_f",
        ("tests/test_moe.py::test_gates_route_drop_and_weigh_as_the_spec[2-4.0-4-True]",),
    ),
    Mutant(
        "an expert keeps one token past its capacity",
        "moe/sharded_moe.py",
        "mask = mask * torch.lt(locations, capacity)",
        "mask = mask * torch.le(locations, capacity)",
        ("tests/test_moe.py::test_gates_route_drop_and_weigh_as_the_spec[1-1.0-2-True]",),
    ),
    Mutant(
        "top-1's auxiliary loss misses its factor of num_experts",
        "moe/sharded_moe.py",
        "l_aux = torch.sum(me * ce) * num_experts",
        "l_aux = torch.sum(me * ce)",
        ("tests/test_moe.py::test_gates_route_drop_and_weigh_as_the_spec[1-8.0-4-True]",),
    ),
    Mutant(
        "tokens are dispatched scaled by their gate weights (applied twice)",
        "moe/sharded_moe.py",
        'torch.einsum("sec,sm->ecm", dispatch_mask.type_as(hidden), tokens)',
        'torch.einsum("sec,sm->ecm", combine_weights.type_as(hidden), tokens)',
        ("tests/test_moe.py::test_the_layer_is_a_weighted_sum_of_each_tokens_experts[1-False]",),
    ),
    Mutant(
        "expert gradients are not divided by ep",
        "moe/sync.py",
        "        return grad / ep",
        "        return grad",
        (
            "tests/test_moe.py::test_expert_parallel_gpt_matches_single_process"
            "[ep2-top1-drops-stage0]",
        ),
    ),
    Mutant(
        "checkpoints key experts by their local index",
        "moe/utils.py",
        "            first = ep_rank * m.num_local_experts",
        "            first = 0",
        ("tests/test_moe.py::test_an_ep_checkpoint_resumes_and_loads_at_ep_1_and_4",),
    ),
    Mutant(
        "moe routing: DeepSeek's top k summed in sorted order (HF takes topk unsorted)",
        "moe/routing.py",
        "    chosen = torch.topk(choice, r.top_k, dim=-1, sorted=r.sorted)[1]",
        "    chosen = torch.topk(choice, r.top_k, dim=-1)[1]",
        ("tests/test_moe_routing.py::test_the_experts_and_weights_are_the_hf_routers",),
    ),
    Mutant(
        "moe routing: DeepSeek-V3's correction bias left out of the choice",
        "moe/routing.py",
        "    choice = scores if bias is None else scores + bias",
        "    choice = scores",
        ("tests/test_moe_routing.py::test_the_experts_and_weights_are_the_hf_routers",),
    ),
    Mutant(
        "moe routing: the weights read from the biased, masked scores",
        "moe/routing.py",
        "    weights = scores.gather(1, chosen)",
        "    weights = choice.gather(1, chosen)",
        ("tests/test_moe_routing.py::test_the_experts_and_weights_are_the_hf_routers",),
    ),
    Mutant(
        "moe routing: the top-k weights never renormalized",
        "moe/routing.py",
        "    if r.normalize:",
        "    if False:",
        ("tests/test_moe_routing.py::test_the_experts_and_weights_are_the_hf_routers",),
    ),
    Mutant(
        "moe routing: DeepSeek-V2's groups scored by their best two, not their best",
        "moe/routing.py",
        "            group_scores = per_group.max(dim=-1).values",
        "            group_scores = per_group.topk(2, dim=-1)[0].sum(dim=-1)",
        (
            "tests/test_moe_routing.py::test_the_experts_and_weights_are_the_hf_routers",
            "tests/test_moe_routing.py::test_grouped_routing_keeps_to_the_best_groups",
        ),
    ),
    Mutant(
        "moe routing: routed_scaling_factor dropped",
        "moe/routing.py",
        "    if r.scale != 1.0:",
        "    if False:",
        ("tests/test_moe_routing.py::test_the_experts_and_weights_are_the_hf_routers",),
    ),
    Mutant(
        "moe routing: Qwen's weights left in fp32",
        "moe/routing.py",
        '    if r.weights_dtype == "logits":',
        "    if False:",
        ("tests/test_moe_routing.py::test_the_experts_and_weights_are_the_hf_routers",),
    ),
    Mutant(
        "moe routing: every expert eligible whatever its group",
        "moe/routing.py",
        "    if r.groups > 1:",
        "    if False:",
        (
            "tests/test_moe_routing.py::test_the_experts_and_weights_are_the_hf_routers",
            "tests/test_moe_routing.py::test_grouped_routing_keeps_to_the_best_groups",
        ),
    ),
]
