"""Recipes: every shipped one loads and maps to the LocalCluster it describes; mistakes are named."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.serve.cli import _configs, _parser
from benchmarks.serve.recipes import RecipeError, load_recipe

RECIPES = sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))


def test_recipes_are_shipped():
    names = {p.stem for p in RECIPES}
    assert {"sweep-1p1d", "chunked-on", "chunked-off", "disagg-1p1d", "colocated", "store-on-multiturn",
            "store-off-multiturn"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_each_recipe_loads_into_configs(path):
    r = load_recipe(path)
    ns = _parser("t", ab=False).parse_args([])
    _t, w, load, _rep = _configs(ns, r)
    assert load.requests >= 1 and w.workload in ("random", "multi_turn", "accuracy")
    kw = r.deployment.cluster_kwargs()
    assert kw["colocated"] == r.deployment.colocated


def test_ab_pairs_differ_only_in_what_they_compare():
    def dep(name):
        return load_recipe(next(p for p in RECIPES if p.stem == name))
    on, off = dep("chunked-on"), dep("chunked-off")
    assert "--no-chunked-transfer" in off.deployment.cluster_kwargs()["extra"]["router"]
    assert "--no-chunked-transfer" not in on.deployment.cluster_kwargs()["extra"]["router"]
    assert on.sections == off.sections
    s_on, s_off = dep("store-on-multiturn"), dep("store-off-multiturn")
    assert s_on.deployment.cluster_kwargs()["kvstore"] == "embedded"
    assert s_off.deployment.cluster_kwargs()["kvstore"] is None
    assert s_on.sections == s_off.sections
    assert dep("disagg-1p1d").sections == dep("colocated").sections
    a1, a2 = dep("accuracy-1p1d-fp32"), dep("accuracy-colocated-fp32")
    assert a1.sections == a2.sections and a1.deployment.dtype == a2.deployment.dtype == "float32"
    assert a2.deployment.colocated and not a1.deployment.colocated


def test_flags_override_recipe_values(tmp_path):
    r = load_recipe(next(p for p in RECIPES if p.stem == "sweep-1p1d"))
    ns = _parser("t", ab=False).parse_args(["--concurrency", "2,3", "--output-tokens", "5"])
    _t, w, load, _rep = _configs(ns, r)
    assert load.concurrency == (2, 3) and w.output_tokens == 5 and w.input_tokens == 256


@pytest.mark.parametrize("text, why", [
    ("deployment: {prefil: 1}", "prefil"),
    ("workload: {input_tokenz: 3}", "input_tokenz"),
    ("deployment: {tp: 2}", "tensor parallel"),
    ("deployment: {kvstore: redis}", "kvstore"),
    ("deployment: {dtype: fp8}", "dtype"),
    ("deployment: {prefill: 0, decode: 1}", "prefill"),
    ("extras: {}", "unknown top-level"),
    ("- a list", "mapping"),
])
def test_bad_recipes_are_named(tmp_path, text, why):
    p = tmp_path / "bad.yaml"
    p.write_text(text + "\n")
    with pytest.raises(RecipeError, match=why):
        load_recipe(p)


def test_yaml_is_plain_data(tmp_path):
    p = tmp_path / "evil.yaml"
    p.write_text("name: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(RecipeError):
        load_recipe(p)
