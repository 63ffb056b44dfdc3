"""Parametrization shared by the test modules."""

import pytest

from sparse_mla_attn._inputs import case_ids, gluon_skip_reason

BACKEND_CASE_ARGS = ("backend", "h_q", "d_qk", "topk")


def _backend_case(case: tuple) -> object:
    reason = gluon_skip_reason(case[0])
    skip = pytest.mark.skipif(reason is not None, reason=reason or "")
    return pytest.param(*case, id=case_ids(BACKEND_CASE_ARGS, [case])[0], marks=skip)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test whose arguments are ``backend, h_q, d_qk, topk`` runs over its module's ``GPU_BACKEND_CASES``
    (ids like ``gluon-H128-D576-T1000``); a Gluon case is skipped unless an sm_90 GPU is present."""
    if set(BACKEND_CASE_ARGS) <= set(metafunc.fixturenames):
        metafunc.parametrize(BACKEND_CASE_ARGS, [_backend_case(c) for c in metafunc.module.GPU_BACKEND_CASES])
