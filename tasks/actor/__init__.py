"""The actor: the trainer's side of RL post-training, one module a job.

    entries.py     the task functions the graph calls (advantages, actor_init / _update / _update_offload / _state /
                   _eval_weights / _export), on the actor's worker where the Actor is resident
    distributed.py the same for R ranks: one torch.distributed process group, the policy sharded by FSDP2
    loop.py        THE update loop for 1 and R ranks (batching, the losses' use, critic warm-up, target_kl, metrics,
                   the randomness rule)
    optim.py       the optimizer (param groups by learning rate, lr_scale, anneal) and the step rule
    state.py       THE state format (weights, FQN-keyed optimizer, RNG) for 1..R ranks, on
                   torch.distributed.checkpoint.state_dict
    actor.py       the resident Actor and its moving average of the weights
    nonfinite.py   non-finite rollout fields: screened, refused or masked and counted
    export.py      the hf (`save_pretrained`) export

Nothing is imported here: import the module you need (`from tasks.actor import entries`).
"""
