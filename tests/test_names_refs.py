"""Name validation and reference parsing: the API boundary for hostile input."""

from __future__ import annotations

import uuid

import pytest

from ckptstore.errors import InvalidNameError
from ckptstore.names import validate_metric_name, validate_name, validate_tag
from ckptstore.refs import parse_ref


@pytest.mark.parametrize(
    "bad",
    ["", "a/b", "../x", "a..b", ".hidden", "nul\x00", "x" * 201, "has space", "a@b", "a:b",
     "-lead", "é" * 101, "a\\b", 5, None],
)
def test_bad_names_rejected(bad: object) -> None:
    with pytest.raises(InvalidNameError):
        validate_name(bad)
    with pytest.raises(ValueError):  # InvalidNameError is also a ValueError
        validate_tag(bad)


@pytest.mark.parametrize("good", ["run-a", "exp1.v2", "A_b+c=d,e", "x" * 200, "0"])
def test_good_names_pass(good: str) -> None:
    assert validate_name(good) == good


def test_metric_names() -> None:
    assert validate_metric_name("val/loss") == "val/loss"
    for bad in ["1loss", "a b", "x;drop", "../x", ""]:
        with pytest.raises(InvalidNameError):
            validate_metric_name(bad)


def test_ref_forms() -> None:
    ident = str(uuid.uuid4())
    assert parse_ref(ident).id == ident
    assert parse_ref("r@latest").kind == "latest"
    assert parse_ref("r@120").step == 120
    assert parse_ref("r@v7").version == 7
    best = parse_ref("r@best:val_loss")
    assert (best.metric, best.mode) == ("val_loss", "min")
    assert parse_ref("r@best:acc:max").mode == "max"
    assert parse_ref("prod").alias == "prod"


@pytest.mark.parametrize(
    "bad", ["", "r@", "r@vx", "r@best", "r@best:loss:up", "r@-1", "../r@latest", "a/b", "r@1.5"]
)
def test_bad_refs(bad: str) -> None:
    with pytest.raises(InvalidNameError, match=r"reference|not allowed|must|contains"):
        parse_ref(bad)
