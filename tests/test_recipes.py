"""Recipe schema: shipped recipes, errors with the YAML line, the cubic GMP schedule."""

from __future__ import annotations

from pathlib import Path

import pytest

from prunekit.recipes import RecipeError, Schedule, gmp_sparsity, list_recipes, load_recipe, parse_recipe, recipes_dir

SHIPPED = {
    "unstructured-50-oneshot-wanda",
    "2of4-oneshot-sparsegpt",
    "unstructured-90-gmp-distill",
    "block32-80-gmp-distill",
}

VALID = """\
name: r
prune:
  method: magnitude
  targets:
    - pattern: unstructured
      sparsity: 0.5
"""


def test_shipped_recipes_load_and_are_the_top_level_folder():
    recipes = {r.name for r in list_recipes()}
    assert SHIPPED <= recipes
    top = Path(__file__).resolve().parents[1] / "recipes"
    assert {p.stem for p in top.glob("*.yaml")} == recipes
    for path in top.glob("*.yaml"):
        assert (recipes_dir() / path.name).read_bytes() == path.read_bytes()
        assert load_recipe(path.stem).name == path.stem  # each file's name is its recipe name
    assert load_recipe("unstructured-90-gmp-distill").method_label == "gmp+distill"
    assert load_recipe("2of4-oneshot-sparsegpt").prune.targets[0].final_sparsity == 0.5


@pytest.mark.parametrize(
    "text,match",
    [
        (
            VALID.replace("      sparsity: 0.5", "      sparsty: 0.5"),
            ":6: prune.targets.0.sparsty: unknown key 'sparsty'",
        ),
        (VALID + "finetune:\n  steps: 10\n  learning_rate: 1\n", ":9: finetune.learning_rate: unknown key"),
        (VALID.replace("magnitude", "obd"), ":3: prune.method:"),
        (VALID.replace("0.5", "1.5"), ":5: prune.targets.0: sparsity must be in [0, 1)"),
        (VALID.replace("unstructured", '"3:2"'), "has N > M"),
        (VALID.replace("unstructured", "2:4"), ":5: prune.targets.0.pattern: got the number 124: quote N:M patterns"),
        (VALID.replace("name: r\n", ""), ":1: name: missing key 'name'"),
        (VALID + "distillation: {loss: cosine}\n", "distillation needs a finetune section"),
        (VALID + "  schedule: {kind: gmp, end_step: 10}\n", "needs finetune.steps >= prune.schedule.end_step"),
        (
            VALID.replace("unstructured\n      sparsity: 0.5", '"2:4"')
            + "  schedule: {kind: gmp, end_step: 2}\nfinetune: {steps: 4}\n",
            "gmp cannot ramp up an N:M pattern",
        ),
        ("name: r\nprune: [1, 2\n", ":3: not valid YAML"),
        ("- just a list\n", "a recipe is a mapping"),
    ],
)
def test_invalid_recipes_name_the_line_and_the_key(text, match):
    with pytest.raises(RecipeError) as info:
        parse_recipe(text, "my.yaml")
    message = str(info.value)
    assert match in message and message.startswith("my.yaml:") and "\n" not in message


def test_unknown_recipe_lists_the_shipped_ones(tmp_path):
    with pytest.raises(RecipeError, match="2of4-oneshot-sparsegpt"):
        load_recipe("no-such-recipe")
    path = tmp_path / "mine.yaml"
    path.write_text(VALID)
    assert load_recipe(path).name == "r"


def test_gmp_follows_the_cubic_schedule_of_zhu_and_gupta():
    sched = Schedule(kind="gmp", start_step=10, end_step=110, frequency=10, initial_sparsity=0.0)
    assert gmp_sparsity(0, sched, 0.9) == 0.0
    assert gmp_sparsity(10, sched, 0.9) == 0.0
    # s_t = s_f + (s_i - s_f) (1 - (t - t0) / (n dt))^3 at t = 60: 0.9 - 0.9 * 0.5^3
    assert gmp_sparsity(60, sched, 0.9) == pytest.approx(0.9 - 0.9 * 0.125)
    assert gmp_sparsity(65, sched, 0.9) == gmp_sparsity(60, sched, 0.9)  # held between pruning steps
    assert gmp_sparsity(110, sched, 0.9) == 0.9 and gmp_sparsity(500, sched, 0.9) == 0.9
    values = [gmp_sparsity(t, sched, 0.9) for t in range(0, 120)]
    assert values == sorted(values)
