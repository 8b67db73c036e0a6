"""Sampling fields the fuzz test (tests/security/test_fuzz_openapi.py) found breaking the
engine: tiny temperature/top_p/repetition_penalty, and Infinity/NaN, which Python's JSON
parser accepts."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from pdcluster.router.schemas import SAMPLING_EPS, CompletionRequest


def _params(**fields):
    return CompletionRequest(model="m", prompt="x", **fields).sampling_params(4, None, 0)


def test_temperature_below_eps_is_greedy_and_above_is_kept():
    assert _params(temperature=1e-170).temperature == 0.0
    assert _params(temperature=SAMPLING_EPS).temperature == SAMPLING_EPS


def test_tiny_top_p_keeps_the_top_token_instead_of_underflowing():
    assert _params(top_p=5e-324).top_p == SAMPLING_EPS
    assert _params(top_p=0.5).top_p == 0.5


@pytest.mark.parametrize("value", [5e-324, 1e-3, 1e3, 1e300])
def test_absurd_repetition_penalties_are_refused(value):
    with pytest.raises(ValidationError):
        CompletionRequest(model="m", prompt="x", repetition_penalty=value)


@pytest.mark.parametrize("literal", ["Infinity", "NaN", "-Infinity"])
def test_infinity_and_nan_are_refused(literal):
    body = json.loads(f'{{"model": "m", "prompt": "x", "temperature": {literal}}}')
    with pytest.raises(ValidationError):
        CompletionRequest(**body)
