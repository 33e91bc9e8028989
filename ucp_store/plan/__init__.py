"""Pure planning (index math, no I/O): catalog rows and a target topology or live DTensor in, reads out.

``planner`` turns (rows, target, rank) into boxes to read; ``experts`` groups MoE experts for ``ucp show``
and ``ucp plan --ep``.
"""

__all__: list[str] = []
