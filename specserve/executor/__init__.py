"""Tensor parallelism of the target model: one engine replica is one TP group.

Rank 0 runs the whole `Engine` (scheduler, KV manager, drafter, sampling) and drives; ranks
1..N-1 are followers that only run the target's forward on their weight shard, in lockstep.
torch.distributed carries it: NCCL on GPU, gloo on CPU, with a `tcp://host:port` rendezvous that
rank 0 picks (a free port, never a fixed one) and hands to the followers.

- `tp_group.py`: the rendezvous address, group setup and teardown, the KV pool size every rank
  agrees on (each rank's affordable pages, reduced with MIN).
- `runner.py`: the step protocol. `ModelRunner.execute(step, capture)` is the engine's one call per
  step (a direct call at TP size 1); on rank 0 `DriverRunner` first broadcasts the step (a small
  header: command + sizes, then the step's packed int64 buffer), and `follower_loop` on the
  other ranks receives, rebuilds the step and runs the same forward and logits all-gather, until
  a shutdown header.
- `follower.py`: `run_follower(config, rank, size, address)`, the plain-function entry point of a
  follower (what a Ray actor calls).
- `local.py`: a whole group in local processes (rank 0 in the caller), for tests and single hosts.

Drafters run on rank 0 only, unsharded, and never issue collectives. They are small next to the
target: sharding one would add a broadcast plus a collective per layer to every draft step, and
the followers would sit serialised behind rank 0's drafting anyway (it alone schedules and
samples), so there is nothing to win. A standalone draft model is therefore loaded whole on rank
0 (even when it is the target checkpoint itself), and EAGLE / EAGLE-3 / MTP heads, which borrow
the target's embedding and lm_head (vocab-sharded under TP), are bound on rank 0 to whole copies
of `model.embed_tokens.weight` / `lm_head.weight` cut from the same checkpoint tensors. Rank 0's
extra memory is that one embedding (+ lm_head when untied) copy, plus the drafter's KV.
"""
