"""The compiled planner (private): every loop of a plan, all layers in one call.

Numba functions over plain loops and NumPy arrays, in the order a plan runs:

* :mod:`~eplb_core._numba.utils`: compile-time constants, the cached ``njit``, NumPy-order sums;
* :mod:`~eplb_core._numba.counts`: replica counts per expert;
* :mod:`~eplb_core._numba.starts`: stable argsort, LPT packing with equal slots per GPU;
* :mod:`~eplb_core._numba.rounds`: refinement rounds of one row of GPUs (exchanges, re-splits);
* :mod:`~eplb_core._numba.refine`: the refinement driver over all rows, repair of avoidable repeats;
* :mod:`~eplb_core._numba.solve`: strict/global plans (:func:`solve_layers`), packing given items;
* :mod:`~eplb_core._numba.soft`: soft-locality allocation and node trades;
* :mod:`~eplb_core._numba.migrate`: migration-aware re-planning within a slot budget.

The entry points take the whole ``[L, ...]`` problem and loop over the layers inside, so a plan costs
one compiled call and no Python work per layer or per refinement round. Sums of bins and rows follow
NumPy's summation order, so figures computed on the Python side agree to the last bit with the ones the
planner acted on. Machine code is cached on disk (see :func:`eplb_core._numba.utils.njit`).
"""
