"""``flatcake simulate``: a discrete-event, cluster-scale what-if simulator on the agent's own policy.

Byte movement is simulated, decisions are not: FlatCake's placement, scopes and reclaim run in the
real ``LocalCatalog``/``ScopeTable``, its read plans are the real ``plan_restore``, its request order
the real FC-MAS ``Scheduler``; the tiered baselines run SGLang HiCache's prefetch rules
(``loadgen/systems/hicache_rules.py``). Modules, in the order data flows: ``events`` (the virtual clock),
``devices`` (bandwidth, per-command cost, queue depth; profiles with sources), ``hbm`` (per-instance
LRU prefix cache), ``workload`` (trace, page keys, ideal hit), ``cluster`` (the simulated systems: flatcake, dram,
tiered: the registry's names, loadgen/names.py), ``run`` (one point, sweeps in processes),
``results`` (table, JSON, plots).
"""
