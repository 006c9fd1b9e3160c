"""Configuration problems, reported all at once with the stage and key they concern."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ConfigProblem:
    """One thing wrong with a deploy config.

    ``stage`` is the stage id (or ``#index`` when the stage has no usable id), ``None`` for top-level
    problems; ``key`` is the dotted path of the offending key inside that stage (or the top level).
    """

    stage: int | str | None
    key: str
    message: str

    def __str__(self) -> str:
        where = "config" if self.stage is None else f"stage {self.stage}"
        if self.key:
            where += f": {self.key}"
        return f"{where}: {self.message}"


class DeployConfigError(ValueError):
    """A deploy config that cannot be used; ``problems`` lists every issue found."""

    def __init__(self, problems: list[ConfigProblem], source: str | None = None) -> None:
        self.problems = list(problems)
        self.source = source
        super().__init__(self.render())

    def render(self) -> str:
        head = f"{self.source}: " if self.source else ""
        lines = [f"{head}{len(self.problems)} problem(s) in the deploy config:"]
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)

    def by_stage(self) -> dict[int | str | None, list[ConfigProblem]]:
        grouped: dict[int | str | None, list[ConfigProblem]] = {}
        for problem in self.problems:
            grouped.setdefault(problem.stage, []).append(problem)
        return grouped
