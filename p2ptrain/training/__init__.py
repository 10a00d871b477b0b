"""The training layer: task specs, the model registry, the local trainer, coordinator election,
round bookkeeping, and signed model records with attestations.

Modules, each with one job:

- :mod:`~p2ptrain.training.task`: the task file (strict TOML) and its canonical bytes.
- :mod:`~p2ptrain.training.models`: the registry of model builders a task may name.
- :mod:`~p2ptrain.training.trainer`: local gradients, the averaged step, evaluation, state bytes.
- :mod:`~p2ptrain.training.election`: the coordinator election state machine.
- :mod:`~p2ptrain.training.rounds`: plans, spans, retries, checkpoints.
- :mod:`~p2ptrain.training.records`: deterministic model bytes, records, attestations, the chain.
- :mod:`~p2ptrain.training.signing`: detached signatures for bodies that outlive pubsub.
- :mod:`~p2ptrain.training.demo`: the demo's task file (``p2ptrain demo``, tests, benches).

Nothing is re-exported here: import what you use from its module.
"""
