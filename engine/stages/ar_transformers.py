"""Autoregressive stages on transformers: seeded decoding with streamed progress, deltas and cancellation.

Model families subclass :class:`TransformersARStage` and say how a job becomes model inputs
(:meth:`prepare`) and what extra outputs it leaves (:meth:`finish`). This module owns the generation
loop: sampling parameters, seeding, per-token progress and text deltas, stop on cancel.

Two loops (docs/batching.md):

- A family that offers a :class:`FastDecoder` gets the lean loop, continuously batched: each request is
  prefilled alone as it arrives, then joins the rows decoding together, one forward per token for all,
  with transformers' own logits processors and a ``torch.Generator`` per request seeded with the request
  seed. The decoder keeps every row's float math identical to running alone, so token ids, and the
  pictures made from them, never depend on the neighbours (``tests/test_batch_invariance.py``), and picks
  ``generate``'s ids (``tests/test_ar_decode.py``).
- Otherwise (or for generation options the lean loop does not implement) ``generate`` runs one request at
  a time after reseeding the process-global torch RNG with the request seed, as GLM-Image's own pipeline
  does.
"""

from __future__ import annotations

import queue
import threading
import time
from abc import abstractmethod
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
from transformers import LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor

from engine.client_load import yields_to
from engine.events import FinishReason, StageStatus, TokenProgress
from engine.modality import OutputModality
from engine.stages.ar_sampling import LEAN_PROCESSORS, sampling_kwargs
from engine.stages.base import JobDone, StageCancelled, StageJob, StageRunner, intra_op_threads_for
from engine.stages.token_choice import choice_holds, choice_key, choose, process

# The RNG is process-global: two AR stages (two engines in one process) must not interleave seeding.
GLOBAL_RNG_LOCK = threading.Lock()
PROGRESS_INTERVAL_S = 0.05
DECODE_STATE = "decode_state"  # job.scratch: a lean row's decode state, for finish (the Omni thinker's)


@dataclass
class ARInputs:
    """What :meth:`TransformersARStage.prepare` hands to ``generate``."""

    model_inputs: dict[str, Any]
    max_new_tokens: int
    generate_kwargs: dict[str, Any] = field(default_factory=dict)
    extra_outputs: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_length(self) -> int:
        return int(self.model_inputs["input_ids"].shape[-1])


class FastDecoder(Protocol):
    """A family's lean decode step: prefill one request alone, then decode many rows per forward.

    ``step`` must give every row exactly the logits it would get alone (same float math), so that
    batching never changes a request's tokens.
    """

    def supports(self, model_inputs: dict[str, Any]) -> bool:
        """Whether these inputs can take the lean loop (else ``generate``)."""

    def prefill(self, model_inputs: dict[str, Any]) -> tuple[torch.Tensor, Any]:
        """Run the prompt alone: (float32 logits of the next token, shape (1, V); the row's decode state)."""

    def step(self, states: list[Any], tokens: torch.Tensor, steps: list[int]) -> torch.Tensor:
        """Feed each row its last token (``tokens``: (B,)); ``steps[i]`` = tokens row i generated before
        this one. Returns float32 logits (B, V)."""

    def release(self, state: Any) -> None:
        """The row is done (finished, cancelled or failed): free what its state holds."""

    @property
    def decode_path(self) -> str:
        """How ``step`` batches rows on this machine, in words (which kernel checks passed)."""


@dataclass(eq=False)  # rows compare by identity
class _Row:
    """One request in the lean loop."""

    job: StageJob
    prepared: ARInputs
    processors: LogitsProcessorList
    eos: frozenset[int]  # ids that end the row
    # min_new_tokens: until the row has this many tokens its end ids (those in the logits' range) score
    # -inf, as transformers' MinNewTokensLengthLogitsProcessor does; done here so that a greedy row keeps
    # the batch's one argmax instead of a processor call per row and token.
    hold_ends: int
    end_ids: torch.Tensor | None
    sample: bool
    choice: tuple[Any, ...] | None  # rows of an equal key may choose their tokens together (token_choice)
    generator: torch.Generator | None
    sequence: torch.Tensor  # prompt + room for every new token: the ids the processors see
    state: Any = None
    logits: torch.Tensor | None = None
    length: int = 0  # tokens in ``sequence`` so far
    generated: int = 0
    reported: int = 0  # generated tokens already sent as deltas
    last_report: float = 0.0
    done: bool = False
    on_done: JobDone | None = None  # the engine's callback (continuous batching)

    @property
    def prompt_length(self) -> int:
        return self.prepared.prompt_length

    def ids(self) -> torch.Tensor:
        return self.sequence[self.prompt_length : self.length]


class _StreamHook(StoppingCriteria):
    """Called by ``generate`` after every token: report progress and deltas, stop on cancel."""

    def __init__(self, stage: TransformersARStage, job: StageJob, prompt_length: int, total: int) -> None:
        self.stage = stage
        self.job = job
        self.prompt_length = prompt_length
        self.total = total
        self.seen = 0
        self.last_report = 0.0

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        generated = input_ids[0, self.prompt_length :]
        new_ids = generated[self.seen :]
        if new_ids.numel():
            self.stage.emit_delta(self.job, new_ids, generated)
            self.seen = generated.numel()
        now = time.monotonic()
        if now - self.last_report >= PROGRESS_INTERVAL_S or self.seen >= self.total:
            self.last_report = now
            self.job.emit(
                TokenProgress(
                    self.job.request_id, self.job.index, self.stage.stage_id, step=self.seen, total=self.total
                )
            )
        stop = self.job.cancelled
        # torch annotates every tensor as Tensor; BoolTensor is the name transformers' signature uses.
        return cast(
            torch.BoolTensor,
            torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device),
        )


class TransformersARStage(StageRunner):
    """An AR stage whose model is a transformers ``generate``-capable model."""

    kind = "ar"
    backend = "transformers"

    model: Any = None

    @abstractmethod
    def prepare(self, job: StageJob) -> ARInputs:
        """Turn a job into model inputs and the number of tokens to generate."""

    def finish(self, job: StageJob, generated: torch.Tensor, prepared: ARInputs) -> dict[str, Any]:
        """Extra outputs after generation (e.g. source-image ids); default: those ``prepare`` left."""
        return dict(prepared.extra_outputs)

    def decode(self, ids: torch.Tensor) -> str:
        raise NotImplementedError(f"stage {self.stage_id} cannot produce text")

    @property
    def modalities(self) -> tuple[OutputModality, ...]:
        return self.stage.output_modalities

    def emit_delta(self, job: StageJob, new_ids: torch.Tensor, generated: torch.Tensor) -> None:
        """Add one DELTA step: new token ids and/or new text, per the stage's output modalities."""
        delta: dict[str, Any] = {}
        if OutputModality.TOKEN_IDS in self.modalities:
            delta["token_ids"] = new_ids.detach().cpu().clone()
        if OutputModality.TEXT in self.modalities:
            piece = job.advance_text(self.stage_id, self.decode(generated))
            if piece:
                delta["text"] = piece
        if delta:
            job.add_output(delta)

    def total_steps(self, job: StageJob) -> int:
        return int(job.scratch.get("max_new_tokens", 0))

    def fast_decoder(self) -> FastDecoder | None:
        """The family's lean decode step, or None to always use ``generate`` (the default)."""
        return None

    # Hooks of the lean loop for a family whose generate call carries more (the Qwen2.5-Omni talker).
    lean_processors: tuple[type, ...] = LEAN_PROCESSORS  # the logits processors the loop applies

    def prepare_job(self, job: StageJob) -> ARInputs | None:
        """The job's inputs, or None when ``_run_one`` makes its outputs without generating."""
        return self.prepare(job)

    def lean_options(self, prepared: ARInputs) -> dict[str, Any] | None:
        """The generation options of ``prepared.generate_kwargs`` for the lean loop's generation config (a
        ``logits_processor``: generate's argument), or None for ``generate``; default: none may be set."""
        return None if prepared.generate_kwargs else {}

    def row_generator(self, job: StageJob, device: torch.device) -> torch.Generator:
        """A sampling row's generator: the request seed's stream (what the global RNG draws after
        ``torch.manual_seed(seed)``)."""
        return torch.Generator(device=device).manual_seed(int(job.params["seed"]))

    @property
    def decode_path(self) -> str | None:
        decoder = self.fast_decoder()
        if decoder is None:
            return "one request at a time (generate)" if self.model is not None else None
        return decoder.decode_path

    @property
    def intra_op_threads(self) -> int | None:
        if self.model is None:
            return None
        return intra_op_threads_for([self.model], self.device)

    # -- continuous batching --------------------------------------------------------------------------
    # With a lean decoder the runner is ``concurrent``: the stage worker hands it each job as it arrives
    # (up to max_num_seqs in flight) and one scheduler thread prefills newcomers alone, then adds them to
    # the rows decoding together at the next token; each row reports done as soon as it finishes. Rows
    # never change each other's float math, so joining mid-way changes no token (docs/batching.md).

    @property
    def concurrent(self) -> bool:  # type: ignore[override]  # a class attribute on the base; here a model's
        return self.fast_decoder() is not None

    @property
    def pauses_rows(self) -> bool:  # type: ignore[override]  # the lean loop steps at most max_num_seqs rows
        return self.concurrent

    _inbox: queue.SimpleQueue[tuple[StageJob, JobDone] | None] | None = None
    _scheduler: threading.Thread | None = None

    def submit(self, job: StageJob, done: JobDone) -> None:
        if self._scheduler is None:
            self._inbox = queue.SimpleQueue()
            self._scheduler = threading.Thread(
                target=self._schedule, name=f"omni-ar-decode-{self.stage_id}", daemon=True
            )
            self._scheduler.start()
        assert self._inbox is not None
        self._inbox.put((job, done))

    def close(self) -> None:
        if self._scheduler is not None and self._inbox is not None:
            self._inbox.put(None)
            self._scheduler.join(timeout=30)
            self._scheduler = None
        super().close()

    def _schedule(self) -> None:
        """The decode thread: take newcomers (blocking only when idle), prefill, one step for all rows."""
        inbox = self._inbox
        assert inbox is not None
        rows: list[_Row] = []
        if self.intra_op_threads is not None:
            torch.set_num_threads(self.intra_op_threads)  # this thread's setting only
        with torch.inference_mode():
            while True:
                arrivals: list[tuple[StageJob, JobDone] | None] = []
                if not rows:
                    arrivals.append(inbox.get())
                while True:
                    try:
                        arrivals.append(inbox.get_nowait())
                    except queue.Empty:
                        break
                if None in arrivals:
                    for row in rows:
                        self._end_row(row, StageStatus.CANCELLED, None)
                    for item in arrivals:
                        if item is not None:
                            item[1](StageStatus.CANCELLED, None)
                    return
                for job, done in cast(list[tuple[StageJob, JobDone]], arrivals):
                    admitted = self._admit(job, done)
                    if admitted is not None:
                        rows.append(admitted)
                rows = self._advance(rows)

    def _admit(self, job: StageJob, done: JobDone) -> _Row | None:
        """Prepare and prefill a newcomer; jobs the lean loop cannot take run through ``generate`` here."""
        decoder = self.fast_decoder()
        try:
            if job.cancelled:
                raise StageCancelled()
            prepared = self.prepare_job(job)
            if prepared is not None:
                job.scratch["max_new_tokens"] = prepared.max_new_tokens
                job.input_tokens = prepared.prompt_length
            if decoder is None or prepared is None or (row := self._lean_row(decoder, job, prepared)) is None:
                self._run_one(job, prepared)
                done(StageStatus.SUCCEEDED, None)
                return None
            row.on_done = done
            forced = self.forced_reply(prepared)
            prefill_forced = getattr(decoder, "prefill_forced", None)
            if forced is not None and prefill_forced is not None:
                self._force(row, prefill_forced, forced)
                return None
            row.logits, row.state = decoder.prefill(prepared.model_inputs)
            job.scratch[DECODE_STATE] = row.state
            return row
        except StageCancelled:
            done(StageStatus.CANCELLED, None)
        except Exception as exc:  # this job fails; the rows decoding go on
            done(StageStatus.FAILED, exc)
        return None

    def _force(
        self,
        row: _Row,
        prefill_forced: Callable[[dict[str, Any], torch.Tensor], tuple[torch.Tensor, Any]],
        forced: torch.Tensor,
    ) -> None:
        """A teacher-forced reply, made at admission instead of in the loop (docs/batching.md,
        "Teacher-forced replies"): one forward alone over the prompt and the reply gives the logits at
        every reply position; each token is then chosen from its position's logits by the row's own
        processors and generator, one after another as the loop's steps choose (the forcing processor
        leaves only the reply's id, and a sampling row draws from its generator once per token, as a
        decode of the reply draws), so the ids, the deltas and the RNG state handed on are the loop's."""
        job = row.job
        logits, row.state = prefill_forced(row.prepared.model_inputs, forced)
        job.scratch[DECODE_STATE] = row.state
        job.scratch["step_rows"] = 1  # computed alone
        for position in range(int(forced.numel())):
            row.logits = logits[position : position + 1]
            self._hold_ends(row)
            token = self._pick(row)
            if token != int(forced[position]):
                raise RuntimeError(
                    f"the forced reply's token {position} is {int(forced[position])}, but the row's "
                    f"processors chose {token}"
                )
            self._take(row, token)
            if row.done:
                break
        self._end_row(row, StageStatus.CANCELLED if job.cancelled else StageStatus.SUCCEEDED)

    def forced_reply(self, prepared: ARInputs) -> torch.Tensor | None:
        """The ids a teacher-forced reply must say (the last one included), or None: the lean loop then
        makes it in one forward where the decoder can (``prefill_forced``). Default: none."""
        return None

    def _stepping(self, rows: list[_Row]) -> tuple[list[_Row], list[_Row]]:
        """The rows that take a step now and those paused. Lighter clients first: a heavy client's rows
        (``yields_to``: at least 4, and twice the fewest any client holds) pause while a much lighter
        client's rows decode, so a quiet client's request decodes at its alone speed beside a client with
        many in flight (engine/client_load.py); clients of similar weight step together.
        Past max_num_seqs (the engine's fair admission gave a client with nothing here a row while
        another held several), the client holding the most stepping rows has its newest paused until the
        count is back at max_num_seqs. A paused row keeps its cache and logits and resumes when the step
        has room again: the same tokens, a little later (docs/batching.md, "Fair admission")."""
        limit = max(1, self.max_batch_size)
        held = Counter(row.job.client for row in rows)
        fewest = min(held.values(), default=0)
        yielding = {client for client, count in held.items() if yields_to(count, fewest)}
        if len(rows) <= limit and not yielding:
            return rows, []
        stepping = [row for row in rows if row.job.client not in yielding]
        paused = [row for row in rows if row.job.client in yielding]
        while len(stepping) > limit:
            counts = Counter(row.job.client for row in stepping)
            most = max(counts.values())
            row = next(r for r in reversed(stepping) if counts[r.job.client] == most)
            stepping.remove(row)
            paused.append(row)
        return stepping, paused

    def _advance(self, rows: list[_Row]) -> list[_Row]:
        """One token for every stepping row (:meth:`_stepping`); finished rows report done at once.
        Returns the rows still decoding."""
        decoder = self.fast_decoder()
        rows_in_order = rows  # admission order: which row is newest
        rows, paused = self._stepping(rows)
        for row in paused:
            if row.job.cancelled:
                row.done = True
                self._end_row(row, StageStatus.CANCELLED)
        paused = [row for row in paused if not row.done]
        try:
            tokens = self._next_tokens(rows)
            for row in rows:
                if row.done:
                    self._end_row(row, StageStatus.CANCELLED if row.job.cancelled else StageStatus.SUCCEEDED)
            chosen = [(row, token) for row, token in zip(rows, tokens, strict=True) if not row.done]
            live = [row for row, _ in chosen]
            if live and decoder is not None:
                logits = decoder.step(
                    [row.state for row in live],
                    torch.tensor([token for _, token in chosen], device=live[0].sequence.device),
                    [row.generated - 1 for row in live],
                )
                for i, row in enumerate(live):
                    row.logits = logits[i : i + 1]
                    scratch = row.job.scratch
                    scratch["step_rows"] = max(scratch.get("step_rows", 0), len(live))
            if not paused:
                return live
            kept = {id(row) for row in live + paused}
            return [row for row in rows_in_order if id(row) in kept]
        except Exception as exc:  # a failing forward fails the rows in it, never the stage
            for row in rows:  # rows that already reported are skipped by _end_row
                row.done = True
                self._end_row(row, StageStatus.FAILED, exc)
            return paused

    def _end_row(self, row: _Row, status: StageStatus, error: Exception | None = None) -> None:
        decoder = self.fast_decoder()
        if row.state is not None and decoder is not None:
            decoder.release(row.state)
        row.state = row.logits = None
        done, row.on_done = row.on_done, None
        if done is None:
            return
        if status == StageStatus.SUCCEEDED:
            try:
                self._finish_row(row)
            except Exception as exc:
                status, error = StageStatus.FAILED, exc
        done(status, error)

    def run(self, jobs: list[StageJob]) -> None:
        """Without a lean decoder: one job at a time through ``generate`` (with one, see ``submit``)."""
        for job in jobs:
            self._run_one(job)

    def _lean_row(self, decoder: FastDecoder, job: StageJob, prepared: ARInputs) -> _Row | None:
        """A lean-loop row for the job, or None if it needs ``generate`` (options the loop lacks)."""
        options = self.lean_options(prepared)
        if options is None or not decoder.supports(prepared.model_inputs):
            return None
        custom = LogitsProcessorList(options.pop("logits_processor", None) or [])  # generate's argument
        model = self.model
        kwargs = {**sampling_kwargs(job.params), **self._generation_limits(job, prepared), **options}
        config, unused = self._generation_config(kwargs)
        if unused or config.num_beams not in (None, 1) or config.stop_strings or config.max_length is None:
            return None
        input_ids = prepared.model_inputs["input_ids"]
        model._prepare_special_tokens(config, True, device=input_ids.device, batch_size=1)
        processors = model._get_logits_processor(
            generation_config=config,
            input_ids_seq_length=prepared.prompt_length,
            encoder_input_ids=input_ids,
            logits_processor=custom,
            device=input_ids.device,
            model_kwargs={},
        )
        if not all(isinstance(p, self.lean_processors) for p in processors):
            return None
        hold = [p for p in processors if isinstance(p, MinNewTokensLengthLogitsProcessor)]
        processors = LogitsProcessorList(
            [p for p in processors if not isinstance(p, MinNewTokensLengthLogitsProcessor)]
        )
        sample = bool(config.do_sample)
        generator = self.row_generator(job, input_ids.device) if sample else None
        sequence = torch.empty(
            prepared.prompt_length + prepared.max_new_tokens, dtype=torch.long, device=input_ids.device
        )
        sequence[: prepared.prompt_length] = input_ids[0]
        eos = config._eos_token_tensor
        eos_ids = frozenset() if eos is None else frozenset(eos.reshape(-1).tolist())
        held = [i for i in sorted(eos_ids) if i < self._vocabulary_size()] if hold else []
        return _Row(
            job=job,
            prepared=prepared,
            processors=processors,
            eos=eos_ids,
            hold_ends=hold[0].min_new_tokens if hold and held else 0,
            end_ids=torch.tensor(held, device=input_ids.device) if hold and held else None,
            sample=sample,
            choice=choice_key(processors, sample),
            generator=generator,
            sequence=sequence,
            length=prepared.prompt_length,
        )

    _generation_configs: dict[str, tuple[Any, dict[str, Any]]] | None = None
    _generation_configs_of: Any = None  # the model they were built from

    def _generation_config(self, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """``model._prepare_generation_config`` for these options, built once per distinct options (it
        deep-copies the model's configs: ~9 ms a request on the tiny models); the model never changes."""
        if (
            self._generation_configs is None
            or self._generation_configs_of is not self.model
            or len(self._generation_configs) > 256
        ):
            self._generation_configs, self._generation_configs_of = {}, self.model
        key = repr(sorted(kwargs.items()))
        if key not in self._generation_configs:
            self._generation_configs[key] = self.model._prepare_generation_config(None, **kwargs)
        return self._generation_configs[key]

    def _vocabulary_size(self) -> int:
        """How many ids the model's logits cover (its LM head's rows)."""
        return int(self.model.get_output_embeddings().weight.shape[0])

    def _next_tokens(self, rows: list[_Row]) -> list[int]:
        """Every row's next token. Greedy rows without processors take one argmax for all (the first
        maximum of each row either way, so the same ids as alone)."""
        for row in rows:
            self._hold_ends(row)
        plain = [i for i, row in enumerate(rows) if not row.sample and not row.processors]
        picked: dict[int, int] = {}
        if len(plain) > 1:
            scores = torch.cat([cast(torch.Tensor, rows[i].logits) for i in plain])
            picked = dict(zip(plain, torch.argmax(scores, dim=-1).tolist(), strict=True))
        picked.update(self._choose_together([i for i in range(len(rows)) if i not in picked], rows))
        tokens = []
        for i, row in enumerate(rows):
            token = picked[i] if i in picked else self._pick(row)
            self._take(row, token)
            tokens.append(token)
        return tokens

    @staticmethod
    def _hold_ends(row: _Row) -> None:
        """Until the row has ``min_new_tokens`` its end ids score -inf (``_Row.hold_ends``)."""
        if row.generated < row.hold_ends and row.logits is not None:
            row.logits[:, row.end_ids] = -float("inf")

    _choice_checks: dict[tuple[Any, ...], bool] | None = None  # (choice key, rows) -> choice_holds

    def _choose_together(self, indices: list[int], rows: list[_Row]) -> dict[int, int]:
        """The next tokens of rows that share their processors, chosen together where this machine's
        kernels give each row its alone bits (engine/stages/token_choice.py); the rest pick alone."""
        groups: dict[tuple[Any, ...], list[int]] = {}
        for i in indices:
            key = rows[i].choice
            if key is not None:
                groups.setdefault(key, []).append(i)
        picked: dict[int, int] = {}
        if self._choice_checks is None:
            self._choice_checks = {}
        for key, members in groups.items():
            if len(members) < 2:
                continue
            first = rows[members[0]]
            logits = torch.cat([cast(torch.Tensor, rows[i].logits) for i in members])
            check = (key, len(members))
            if check not in self._choice_checks:
                self._choice_checks[check] = choice_holds(
                    first.processors, first.sample, len(members), int(logits.shape[-1]), logits
                )
            if not self._choice_checks[check]:
                continue
            tokens = choose(
                first.processors,
                first.sample,
                logits,
                [rows[i].sequence[: rows[i].length] for i in members],
                [rows[i].generator for i in members],
            )
            picked.update(zip(members, tokens, strict=True))
        return picked

    def _pick(self, row: _Row) -> int:
        """The row's next token as ``generate`` would pick it (processors, then argmax or multinomial)."""
        scores = row.logits
        assert scores is not None
        if row.processors:
            # Called directly (token_choice.process): LogitsProcessorList.__call__ would inspect each
            # one's signature on every token.
            scores = process(row.processors, row.sequence[None, : row.length], scores)
        if row.sample:
            probs = torch.nn.functional.softmax(scores, dim=-1)
            return int(torch.multinomial(probs, num_samples=1, generator=row.generator)[0, 0])
        return int(torch.argmax(scores, dim=-1)[0])

    def _take(self, row: _Row, token: int) -> None:
        """Append the token; the row is done at its limit, an end id, or a cancel."""
        row.sequence[row.length] = token
        row.length += 1
        row.generated += 1
        if row.generated >= row.prepared.max_new_tokens or token in row.eos or row.job.cancelled:
            row.done = True
        self._report(row)

    def _report(self, row: _Row) -> None:
        """Deltas and progress at most every PROGRESS_INTERVAL_S (and at the end)."""
        now = time.monotonic()
        if not row.done and now - row.last_report < PROGRESS_INTERVAL_S:
            return
        row.last_report = now
        job = row.job
        if row.generated > row.reported and not job.cancelled:
            generated = row.ids()
            self.emit_delta(job, generated[row.reported :], generated)
            row.reported = row.generated
        job.emit(
            TokenProgress(
                job.request_id,
                job.index,
                self.stage_id,
                step=row.generated,
                total=row.prepared.max_new_tokens,
            )
        )

    def _finish_row(self, row: _Row) -> None:
        job = row.job
        if job.cancelled:
            return
        generated = row.ids().detach().cpu().clone()
        job.output_tokens = int(generated.numel())
        job.finish_reason = (
            FinishReason.LENGTH if generated.numel() >= row.prepared.max_new_tokens else FinishReason.STOP
        )
        extras = self.finish(job, generated, row.prepared)
        if extras:
            job.add_output(extras)

    def _generation_limits(self, job: StageJob, prepared: ARInputs) -> dict[str, Any]:
        params = job.params
        limits: dict[str, Any] = {"max_new_tokens": prepared.max_new_tokens}
        if params.get("min_tokens"):
            limits["min_new_tokens"] = int(params["min_tokens"])
        stop_ids = list(params.get("stop_token_ids") or [])
        if params.get("ignore_eos"):
            limits["eos_token_id"] = stop_ids or None
        elif stop_ids:
            eos = self.model.generation_config.eos_token_id
            eos_list = [eos] if isinstance(eos, int) else list(eos or [])
            limits["eos_token_id"] = eos_list + [i for i in stop_ids if i not in eos_list]
        return limits

    def _run_one(self, job: StageJob, prepared: ARInputs | None = None) -> None:
        if job.cancelled:
            raise StageCancelled()
        if prepared is None:
            prepared = self.prepare(job)
        kwargs, hook = self.generate_call(job, prepared)
        with GLOBAL_RNG_LOCK, torch.inference_mode():
            torch.manual_seed(int(job.params["seed"]))
            output = self.model.generate(**kwargs)
        generated = self.generated_tokens(job, output, prepared, hook)
        extras = self.finish(job, generated, prepared)
        if extras:
            job.add_output(extras)

    def generate_call(self, job: StageJob, prepared: ARInputs) -> tuple[dict[str, Any], _StreamHook]:
        """``generate``'s arguments for one request, with the hook that streams its tokens and stops it
        when cancelled; records the prompt's length and budget on the job."""
        job.scratch["max_new_tokens"] = prepared.max_new_tokens
        job.input_tokens = prepared.prompt_length
        hook = _StreamHook(self, job, prepared.prompt_length, prepared.max_new_tokens)
        kwargs = {
            **prepared.model_inputs,
            **sampling_kwargs(job.params),
            **self._generation_limits(job, prepared),
            **prepared.generate_kwargs,
            "stopping_criteria": StoppingCriteriaList([hook]),
        }
        return kwargs, hook

    def generated_tokens(
        self, job: StageJob, sequences: torch.Tensor, prepared: ARInputs, hook: _StreamHook
    ) -> torch.Tensor:
        """The new tokens of ``generate``'s output (on the CPU): the last ones streamed, the token counts
        and the finish reason recorded (raises StageCancelled when the request was cancelled)."""
        if job.cancelled:
            raise StageCancelled()
        generated = sequences[0, prepared.prompt_length :].detach().cpu()
        if generated.numel() > hook.seen:  # the last token(s) after the final hook call
            self.emit_delta(job, generated[hook.seen :], generated)
        job.output_tokens = int(generated.numel())
        job.finish_reason = (
            FinishReason.LENGTH if generated.numel() >= prepared.max_new_tokens else FinishReason.STOP
        )
        return generated
