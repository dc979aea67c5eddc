"""The training loop: one Accelerate setup for every stage (single device, DDP or FSDP come from
`accelerate launch` / its config, not from this code).

Per stage: choose the trainable parameters, build AdamW and the LR schedule, prepare, then step.
After every optimizer step the mixing matrices are clipped to [0, 1]. Checkpoints carry the model,
optimizer, schedule and RNG state; batches and noise depend only on (seed, stage, step), so a
resumed run ends with the same weights as an uninterrupted one. A run whose model diverges stops
before it saves anything from it (divergence.py).
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import replace
from pathlib import Path

import torch
import yaml
from accelerate.utils import DistributedType
from tqdm.auto import tqdm

from .. import __version__
from ..convert import PLAN_ATTR
from ..finite import watch_outputs
from ..io import check_writable
from ..locations import components_of
from ..mixing import clamp_mixing_
from . import checkpoints
from .build import build_model
from .data import build_dataset, check_data_path, loader
from .divergence import StageGuard, diverged_message
from .errors import TrainError
from .lora import add_lora, has_lora, remove_lora, save_adapter
from .metrics import MetricsFile
from .objectives import Distillation
from .params import select_trainable
from .recipe import Recipe, StageSpec
from .transfer import AttentionTransfer
from .validation import BEST_DIR, BestModel, HeldOut, SampleWriter, StageBest, heldout_dataset, split_off


def _flat(d: dict, prefix: str = "") -> dict:
    """Tracker configs take scalars only."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out


def _step_generator(seed: int, stage: int, step: int, micro: int, rank: int) -> torch.Generator:
    """Seed the global RNG (label dropout, LoRA dropout, …) and return a generator for the
    objective's noise, both from (seed, stage, step, micro-step, rank) alone: a resumed run draws
    exactly what the uninterrupted run drew, whatever else consumed random numbers before."""
    derived = hash((seed, stage, step, micro, rank)) & 0x7FFF_FFFF_FFFF_FFFF
    torch.manual_seed(derived)
    return torch.Generator().manual_seed(derived)


def _enable_checkpointing(model) -> None:
    for name in ("enable_gradient_checkpointing", "gradient_checkpointing_enable"):
        if hasattr(model, name):
            getattr(model, name)()
            return
    raise TrainError(f"{type(model).__name__} has no gradient checkpointing; set gradient_checkpointing: false")


def _refuse_unsupported_fsdp(acc, recipe: Recipe) -> None:
    """What FSDP cannot do here, said before any model loads."""
    if acc.distributed_type != DistributedType.FSDP:
        return
    if acc.state.fsdp_plugin.fsdp_version == 1 and any(s.name == "attention_transfer" for s in recipe.stages):
        raise TrainError(
            "attention transfer under FSDP needs FSDP2 (its loss bypasses the model output, which FSDP1's "
            "backward hooks reject): set fsdp_version: 2 in the Accelerate config, or use DDP for this stage"
        )


def _refuse_unhonoured_precision(acc, recipe: Recipe) -> None:
    """Accelerate quietly trains in fp32 when the device cannot run the requested mixed precision
    (fp16 on a CPU): say so before any model loads, instead of a run that is not what it claims."""
    if recipe.precision == "no" or acc.native_amp:
        return
    if acc.distributed_type in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        return  # these engines run the precision themselves
    raise TrainError(
        f"precision: {recipe.precision} cannot run on this {acc.device.type} device (Accelerate would train in "
        f'fp32); set precision: "no", or train on a GPU' + (" (or precision: bf16)" if acc.device.type == "cpu" else "")
    )


TRANSFER_CHECK_BATCHES = 2  # without validation: training batches a transfer stage must not end worse on
RUN_LENGTH_KEYS = re.compile(r"stages\[\d+\]\.steps|checkpoint_every|keep_checkpoints|logging\..*")


def _leaves(value, prefix: str = "") -> dict:
    """A recipe dict as {"optimizer.lr": 0.001, "stages[1].steps": 4, ...}."""
    if isinstance(value, dict):
        named = {(f"{prefix}.{key}" if prefix else key): sub for key, sub in value.items()}
        return {k: v for name, sub in named.items() for k, v in _leaves(sub, name).items()}
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return {k: v for i, sub in enumerate(value) for k, v in _leaves(sub, f"{prefix}[{i}]").items()}
    return {prefix: value}


def _refuse_other_run(out: Path, recipe: Recipe, resume_from: checkpoints.Checkpoint) -> None:
    """A checkpoint continues only the run that wrote it: the recipe may change its length (stages'
    steps, checkpoint_every, keep_checkpoints, logging) but nothing that would train differently."""
    if resume_from.step > recipe.total_steps:
        raise TrainError(
            f"{resume_from.path} is at step {resume_from.step}, beyond this recipe's {recipe.total_steps} steps: "
            "lengthen the stages, or start afresh with a new --out"
        )
    saved_file = out / "recipe.yaml"
    if not saved_file.is_file():
        return
    saved = _leaves(yaml.safe_load(saved_file.read_text()))
    now = _leaves(yaml.safe_load(yaml.safe_dump(recipe.to_dict(), sort_keys=False)))
    missing = "(absent)"
    changed = [
        f"{key}: {saved.get(key, missing)} -> {now.get(key, missing)}"
        for key in dict.fromkeys([*saved, *now])
        if not RUN_LENGTH_KEYS.fullmatch(key) and saved.get(key, missing) != now.get(key, missing)
    ]
    if changed:
        raise TrainError(
            f"{out} holds checkpoints of another recipe ({'; '.join(changed)}): resume with the same recipe "
            "(only stages' steps, checkpoint_every, keep_checkpoints and logging may change), or use a new --out"
        )


def _full_state_into(wrapped, fresh) -> None:
    """Copy a sharded (FSDP) model's weights into an unwrapped model of the same structure, on every
    rank, one tensor at a time (collective: every rank calls it). FSDP2 parameters are DTensors whose
    `full_tensor()` all-gathers; FSDP1 gathers under its FULL_STATE_DICT context."""
    from torch.distributed.tensor import DTensor

    target, state = fresh.state_dict(), wrapped.state_dict()
    if any(isinstance(v, DTensor) for v in state.values()):  # FSDP2
        for name, value in state.items():
            full = value.full_tensor() if isinstance(value, DTensor) else value
            target[name].copy_(full.detach())
        return
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.state_dict_type(
        wrapped, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True, rank0_only=False)
    ):
        state = wrapped.state_dict()
    fresh.load_state_dict(state)


class Trainer:
    def __init__(self, recipe: Recipe, out: str | Path, *, resume: bool = True, log=print):
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        self.recipe, self.out, self.log = recipe, Path(out), log
        if self.out.is_file():
            raise TrainError(f"--out {self.out} is a file; give a directory for the run (new, or one to resume)")
        try:
            check_writable(self.out)
        except ValueError as exc:
            raise TrainError(f"--out: {exc}") from None
        trackers = list(recipe.logging.trackers)
        self.accelerator = Accelerator(
            gradient_accumulation_steps=recipe.gradient_accumulation,
            mixed_precision=recipe.precision,
            log_with=trackers or None,
            project_dir=str(self.out / "logs"),  # tracker files (TensorBoard: logs/<project>/)
            step_scheduler_with_optimizer=False,  # the schedule counts optimizer steps, whatever the world size
        )
        acc = self.accelerator
        _refuse_unhonoured_precision(acc, recipe)
        if resume and acc.is_main_process:
            checkpoints.recover(self.out)
        acc.wait_for_everyone()
        self.resume_from = checkpoints.latest(self.out, __version__) if resume else None
        if not resume and checkpoints.checkpoint_dir(self.out).exists():
            raise TrainError(
                f"{self.out} already holds checkpoints; pick another --out, or resume from them (drop --no-resume)"
            )
        if self.resume_from:
            _refuse_other_run(self.out, recipe, self.resume_from)
        check_data_path(recipe.data)
        _refuse_unsupported_fsdp(acc, recipe)
        set_seed(recipe.seed)
        self.built = build_model(recipe)
        if self.built.report is not None and acc.is_main_process:
            self.log(str(self.built.report))
        model = self.built.model
        if recipe.gradient_checkpointing:
            _enable_checkpointing(model)
            self.built.adapter.prepare_checkpointing(model)
        self.objective = self.built.adapter.objective(recipe.objective)
        # what finetune stages minimise: with objective.distill, mixed with matching the original model (its
        # forward at the training precision); validation and the probe keep the plain objective, comparable
        self.step_objective = self.objective
        if self.built.original is not None:
            self.step_objective = Distillation(self.objective, self.built.original, recipe.objective.distill,
                                               acc.autocast)
        base = components_of(model)
        with acc.main_process_first():  # one process encodes, the others read its cache
            self.dataset = build_dataset(recipe.data, self.built.adapter, model, seed=recipe.seed,
                                         components=recipe.data.components or base)
        self.heldout, self.best = self._heldout(model, recipe.data.components or base), BestModel(self.out)
        # without validation, attention transfer is judged on the task loss of the first training batches
        self.transfer_check = HeldOut(self.dataset, self.objective, recipe.data.batch_size, TRANSFER_CHECK_BATCHES,
                                      recipe.seed)
        # the fixed batch whose outputs must stay finite (divergence.py): the first training examples
        self.probe = self.dataset[list(range(min(len(self.dataset), recipe.data.batch_size)))]
        self.guard: StageGuard | None = None
        self.stage_best, self.watched = StageBest(), None
        acc.register_for_checkpointing(self.stage_best)
        self.samples = self._sample_writer(model, recipe.data.components or base)
        self.model, self.sharded = model, False
        self.dtype = next(model.parameters()).dtype
        start = self.resume_from.step if self.resume_from else 0
        if acc.is_main_process:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "recipe.yaml").write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
            self.metrics = MetricsFile(self.out / "metrics.jsonl", start)
        if trackers:
            acc.init_trackers(recipe.logging.project, config=_flat(recipe.to_dict()))

    def _heldout(self, model, components: str | None) -> HeldOut | None:
        """The validation set: split off the training data, or read from validation.path."""
        v = self.recipe.validation
        if v is None:
            return None
        if v.split is not None:
            try:
                self.dataset, held = split_off(self.dataset, v.split, self.recipe.seed)
            except ValueError as exc:
                raise TrainError(str(exc)) from None
        else:
            with self.accelerator.main_process_first():
                held = heldout_dataset(self.recipe, self.built.adapter, model, components)
            if set(held.columns) != set(self.dataset.columns):
                raise TrainError(
                    f"validation.path {v.path} holds {sorted(held.columns)} but the training data holds "
                    f"{sorted(self.dataset.columns)}: give held-out data of the same kind as data"
                )
        return HeldOut(
            held, self.objective, v.batch_size or self.recipe.data.batch_size, v.num_batches, self.recipe.seed
        )

    def _sample_writer(self, model, base: str | None) -> SampleWriter | None:
        v = self.recipe.validation
        if v is None or not v.num_samples:
            return None
        if self.accelerator.distributed_type == DistributedType.FSDP:
            raise TrainError("validation.num_samples needs the whole model on one process, which FSDP shards: "
                             "set validation.num_samples: 0 (the validation loss still runs)")
        try:
            return SampleWriter(self.built.adapter, model, base, v, self.out, self.recipe.seed)
        except ValueError as exc:
            raise TrainError(str(exc)) from None

    # --- one stage ---------------------------------------------------------------------------------

    def _batch(self, batch: dict) -> dict:
        device = self.accelerator.device
        return {k: v.to(device, self.dtype if v.is_floating_point() else None) for k, v in batch.items()}

    def _run_stage(self, index: int, stage: StageSpec, begin: int, stop_after: int | None) -> int:
        """Returns the global step reached."""
        from transformers import get_scheduler

        acc, recipe = self.accelerator, self.recipe
        end = begin + stage.steps
        if self.sharded:
            self._unshard()
        built = self.built
        model = acc.unwrap_model(self.model)
        acc.free_memory()
        if stage.train == "lora" and not has_lora(model):
            add_lora(model, stage.lora)
        params = select_trainable(model, stage.train, built.adapter)
        opt = recipe.optimizer
        optimizer = torch.optim.AdamW(
            params, lr=stage.lr or opt.lr, betas=tuple(opt.betas), eps=opt.eps, weight_decay=opt.weight_decay
        )
        warmup = min(recipe.schedule.warmup_steps, stage.steps)
        name = "constant_with_warmup" if recipe.schedule.name == "constant" and warmup else recipe.schedule.name
        scheduler = get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=stage.steps)
        self.model, optimizer, scheduler = acc.prepare(model, optimizer, scheduler)
        self.sharded = acc.distributed_type == DistributedType.FSDP
        params = [p for p in self.model.parameters() if p.requires_grad]  # FSDP swaps in sharded parameters
        step = begin
        self.stage_best.reset()
        # a transfer stage that ends above its best held-out loss (without validation: its loss on the first
        # training batches, `transfer_check`) goes back to that best (StageBest)
        watched = stage.name == "attention_transfer" and not self.sharded
        self.watched = (params, end) if watched else None
        self.guard = None
        if self.resume_from and begin < self.resume_from.step <= end:
            acc.load_state(str(self.resume_from.path))
            step = self.resume_from.step
            self.guard = StageGuard.from_state(self.resume_from.guard, index)
            if acc.is_main_process:
                self.log(f"resumed from {self.resume_from.path} (step {step})")
        if self.guard is None:  # the stage starts here (or an older checkpoint recorded no guard)
            _, norm, numel = self._weight_state(params)
            self.guard = StageGuard(index, norm, numel)
        transfer = None
        if stage.name == "attention_transfer":
            transfer = AttentionTransfer(built.students(), built.teachers).to(acc.device).attach()
        elif built.original is not None:  # the distillation teacher joins the model (never prepared nor saved)
            built.original.to(acc.device, self.dtype)
        if step == 0 or (watched and step == begin):
            self._validate(step, stage.name, transfer)
        try:
            return self._steps(index, stage, step, end, model, optimizer, scheduler, params, transfer, stop_after)
        finally:
            if transfer:
                transfer.detach()

    def _unshard(self) -> None:
        """Between stages under FSDP: a sharded model cannot be re-wrapped for another trainable
        set (FSDP fixes which parameters need gradients when it first gathers them, and LoRA would
        add modules to a sharded tree), so gather the trained weights into a fresh build of the same
        model on every rank; the next stage prepares that afresh with its own optimizer. The
        teachers are kept (they were never wrapped)."""
        acc = self.accelerator
        fresh = build_model(self.recipe, teachers=False, plan=getattr(self.built.model, PLAN_ATTR)).model
        if self.recipe.gradient_checkpointing:
            _enable_checkpointing(fresh)
        _full_state_into(self.model, fresh)  # collective
        acc.free_memory()
        self.built = replace(self.built, model=fresh)
        self.model, self.sharded = fresh, False

    def _steps(self, index, stage, step, end, model, optimizer, scheduler, params, transfer, stop_after) -> int:
        acc, recipe = self.accelerator, self.recipe
        accum, begin = recipe.gradient_accumulation, end - stage.steps
        batches = iter(
            loader(
                self.dataset, recipe.data, seed=recipe.seed + index, start=(step - begin) * accum,
                rank=acc.process_index, world=acc.num_processes,
            )
        )
        samples_per_step = recipe.data.batch_size * accum * acc.num_processes
        bar = tqdm(
            total=stage.steps,
            initial=step - begin,
            desc=stage.name,
            disable=not acc.is_local_main_process,
            dynamic_ncols=True,
        )
        self.model.train()
        try:  # a stopped run's error goes on a line of its own, after the bar
            while step < end:
                tic, losses, grad_norm = time.perf_counter(), [], None
                for micro in range(accum):
                    batch = self._batch(next(batches))
                    with acc.accumulate(self.model):
                        generator = _step_generator(recipe.seed, index, step, micro, acc.process_index)
                        if transfer:
                            transfer.take_errors()
                            self.objective.loss(self.model, batch, generator)
                            loss = transfer.take_loss()
                        else:
                            loss = self.step_objective.loss(self.model, batch, generator)
                        acc.backward(loss)
                        if acc.sync_gradients and recipe.optimizer.grad_clip:
                            grad_norm = acc.clip_grad_norm_(params, recipe.optimizer.grad_clip)
                        optimizer.step()
                        optimizer.zero_grad(set_to_none=True)
                    losses.append(loss.detach().float())
                loss = acc.gather(torch.stack(losses).mean()[None]).mean().item()
                if not math.isfinite(loss):
                    raise self._diverged(f"loss became {loss}", step + 1, stage)
                if problem := self.guard.loss_problem(loss):
                    raise self._diverged(problem, step + 1, stage)
                finite, norm, _ = self._weight_state(params)
                if not finite:
                    raise self._diverged("the trained weights became inf/NaN", step + 1, stage)
                if problem := self.guard.weight_problem(norm):
                    raise self._diverged(problem, step + 1, stage)
                scheduler.step()
                clamp_mixing_(model)
                step += 1
                lr = scheduler.get_last_lr()[0]
                throughput = samples_per_step / max(time.perf_counter() - tic, 1e-9)
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", samples_s=f"{throughput:.1f}")
                if step % recipe.logging.every == 0 or step == end:
                    record = {"step": step, "stage": stage.name, "loss": loss, "lr": lr, "samples_per_s": throughput}
                    if grad_norm is not None:
                        record["grad_norm"] = float(grad_norm)
                    if acc.is_main_process:
                        self.metrics.write(record)
                    acc.log({f"{stage.name}/{k}": v for k, v in record.items() if k not in ("step", "stage")},
                            step=step)
                every = recipe.validation.every if recipe.validation else 0
                validate = (every and step % every == 0) or step == end
                save = (recipe.checkpoint_every and step % recipe.checkpoint_every == 0) or step == end
                if validate or save:  # nothing is saved (checkpoint, best model) from a diverged model
                    self._probe(step, stage, transfer)
                if validate:
                    self._validate(step, stage.name, transfer)
                if save:
                    checkpoints.save(acc, self.out, step, index, __version__, recipe.keep_checkpoints,
                                     self.guard.state())
                if stop_after is not None and step >= stop_after:
                    break
        finally:
            bar.close()
        return step

    def _weight_state(self, params: list) -> tuple[bool, float, int]:
        """(every trained weight finite, their L2 norm, their count) over every process, in one small
        gather; FSDP parameters are counted shard by shard, replicated ones once."""
        from torch.distributed.tensor import DTensor

        local = [t for t in ((p.to_local() if isinstance(p, DTensor) else p).detach() for p in params) if t.numel()]
        device = self.accelerator.device
        if local:  # no weight copy: one peak and one norm per tensor
            peak = torch.stack([torch.linalg.vector_norm(t, float("inf")).float() for t in local]).max()
            square = torch.stack([torch.linalg.vector_norm(t).double() for t in local]).square().sum()
        else:
            peak, square = torch.zeros((), device=device), torch.zeros((), dtype=torch.float64, device=device)
        count = torch.tensor(float(sum(t.numel() for t in local)), dtype=torch.float64, device=device)
        gathered = self.accelerator.gather(torch.stack([peak.double().to(device), square.to(device), count])[None])
        finite = bool(gathered[:, 0].isfinite().all())
        totals = gathered[:, 1:].sum(0) if self.sharded else gathered[0, 1:]
        return finite, math.sqrt(float(totals[0])), int(totals[1])

    @torch.no_grad()
    def _probe(self, step: int, stage: StageSpec, transfer: AttentionTransfer | None) -> None:
        """One forward on the fixed probe batch (every process: collective under FSDP); stop the run
        when the model's outputs or the loss on it are not finite."""
        acc = self.accelerator
        model = acc.unwrap_model(self.model)
        was_training = self.model.training
        if transfer:
            transfer.detach()
        self.model.eval()
        try:
            with watch_outputs(model) as watch:
                loss = self.objective.loss(self.model, self._batch(self.probe), torch.Generator().manual_seed(
                    self.recipe.seed))
            finite = torch.tensor(watch.finite and bool(torch.isfinite(loss)), device=acc.device)
        finally:
            self.model.train(was_training)
            if transfer:
                transfer.attach()
        if not bool(acc.gather(finite[None]).all()):
            raise self._diverged("the model's outputs on the probe batch became inf/NaN", step, stage)

    def _diverged(self, what: str, step: int, stage: StageSpec) -> TrainError:
        """The run stops before anything (checkpoint, best or final model) is written from bad weights.
        Every checkpoint passed these checks when it was saved, so the newest is the last good one."""
        recipe = self.recipe
        kept = checkpoints.latest(self.out, __version__)
        lr = stage.lr or recipe.optimizer.lr
        key = f"stages[{self.guard.stage}].lr" if stage.lr and self.guard else "optimizer.lr"
        fixes = [f"lower the learning rate ({key}: {lr:g})"]
        if not recipe.optimizer.grad_clip:
            fixes.append("set optimizer.grad_clip: 1.0")
        if recipe.precision == "fp16":
            fixes.append("use precision: bf16 instead of fp16")
        return TrainError(diverged_message(what, step, stage.name, kept.path if kept else None, fixes))

    def _validate(self, step: int, stage: str, transfer: AttentionTransfer | None) -> None:
        """Held-out loss (and samples) of the model as it stands (the transfer hooks, which hand the
        teachers' outputs downstream, are lifted meanwhile); saves the model when it is the best so far."""
        acc = self.accelerator
        if self.heldout is None:
            if self.watched is not None:
                self._back_to_stage_best(step, stage, self._loss_on(self.transfer_check, transfer), "transfer_check")
            return
        if transfer:
            transfer.detach()
        try:
            loss = self.heldout.loss(self.model, device=acc.device, dtype=self.dtype, rank=acc.process_index,
                                     world=acc.num_processes, gather=acc.gather)
            if self.samples is not None and acc.is_main_process:
                grid = self.samples.write(acc.unwrap_model(self.model), step, acc.device)
                if "tensorboard" in self.recipe.logging.trackers:
                    acc.get_tracker("tensorboard").log_images({"validation/samples": grid}, step=step,
                                                              dataformats="HWC")
        finally:
            if transfer:
                transfer.attach()
        if acc.is_main_process:
            self.metrics.write({"step": step, "stage": stage, "validation_loss": loss})
            self.log(f"step {step} ({stage}): validation loss {loss:.6g}")
        acc.log({"validation/loss": loss}, step=step)
        if self.best.improves(loss):
            directory = self.out / BEST_DIR if self.recipe.validation.keep_best else None
            if directory is not None:
                self._save_model(directory, merge_lora=True)
            if acc.is_main_process:
                self.best.note(step, stage, loss, directory)
        if self.watched is not None:
            self._back_to_stage_best(step, stage, loss, "validation")

    def _loss_on(self, held: HeldOut, transfer: AttentionTransfer | None) -> float:
        """`held`'s loss of the model as it stands (the transfer hooks lifted meanwhile)."""
        acc = self.accelerator
        if transfer:
            transfer.detach()
        try:
            return held.loss(self.model, device=acc.device, dtype=self.dtype, rank=acc.process_index,
                             world=acc.num_processes, gather=acc.gather)
        finally:
            if transfer:
                transfer.attach()

    def _back_to_stage_best(self, step: int, stage: str, loss: float, measure: str) -> None:
        params, end = self.watched
        self.stage_best.offer(step, loss, params)
        if step == end and self.stage_best.loss < loss:
            self.stage_best.restore(params)
            if self.accelerator.is_main_process:
                best, at = self.stage_best.loss, self.stage_best.step
                self.metrics.write({"step": step, "stage": stage, f"{measure}_loss": best, "restored_step": at})
                self.log(f"{stage} ended at {measure} loss {loss:.6g}, above its best {best:.6g} (step {at}): "
                         f"the trained weights go back to step {at}")

    def _save_model(self, target: Path, *, merge_lora: bool) -> None:
        """Save the full model to `target` from the main process (collective under FSDP). A LoRA
        model is saved merged (a copy, when training goes on)."""
        import copy

        from .. import save_pretrained

        model = self._gathered_model()
        if model is None:
            return
        if has_lora(model):
            model = copy.deepcopy(model)
            remove_lora(model, merge=merge_lora)
        save_pretrained(model, target)

    # --- the whole run -----------------------------------------------------------------------------

    def run(self, stop_after: int | None = None) -> Path | None:
        """Train every stage and save the final model; returns its directory (None when stopped
        at step `stop_after`, which simulates an interrupted job)."""
        done = self.resume_from.step if self.resume_from else 0
        begin = step = 0
        for index, stage in enumerate(self.recipe.stages):
            end = begin + stage.steps
            if end >= done:  # the stage holding the checkpoint reloads it; earlier ones are skipped
                step = self._run_stage(index, stage, begin, stop_after)
                if stop_after is not None and step >= stop_after and step < self.recipe.total_steps:
                    self.accelerator.end_training()
                    return None
            begin = end
        return self._finish()

    def _gathered_model(self):
        """The trained model with full weights on the main process (None elsewhere). Under FSDP the
        wrapped model only holds shards: gather the state dict and load it into a fresh build."""
        acc = self.accelerator
        if acc.distributed_type != DistributedType.FSDP:
            return acc.unwrap_model(self.model) if acc.is_main_process else None
        state = acc.get_state_dict(self.model)  # collective
        if not acc.is_main_process:
            return None
        model = build_model(self.recipe, teachers=False, plan=getattr(self.built.model, PLAN_ATTR)).model
        if has_lora(acc.unwrap_model(self.model)):
            add_lora(model, self.recipe.stages[-1].lora)
        model.load_state_dict(state)
        return model

    def _finish(self) -> Path:
        acc = self.accelerator
        self._probe(self.recipe.total_steps, self.recipe.stages[-1], None)  # the final model is never a diverged one
        acc.wait_for_everyone()
        target = self.out / "model"
        model = self._gathered_model()
        if acc.is_main_process:
            from .. import push_to_hub, save_pretrained

            adapter = None
            if has_lora(model):
                lora = self.recipe.stages[-1].lora
                if not lora.merge:
                    adapter = self.out / "adapter"
                    save_adapter(model, adapter, base=str(target))
                remove_lora(model, merge=lora.merge)
            save_pretrained(model, target)
            self.log(f"saved {target}")
            if self.best.summary():
                self.log(self.best.summary())
            if self.recipe.push_to_hub:
                push_to_hub(target, self.recipe.push_to_hub.repo_id, private=self.recipe.push_to_hub.private,
                            adapter=adapter)  # an adapter goes to a repo of its own, on the model
        acc.wait_for_everyone()
        acc.end_training()
        return target


def train(
    recipe: Recipe, out: str | Path, *, resume: bool = True, stop_after: int | None = None, log=print
) -> Path | None:
    return Trainer(recipe, out, resume=resume, log=log).run(stop_after=stop_after)
