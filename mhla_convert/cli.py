"""The `mhla-convert` command line (typer).

`mhla-convert MODEL [options]` converts (the default command), beside `list`, `push`, `demo` and,
once the training package provides them, `finetune` and `sample`. Errors are one line on stderr
and exit code 2, never a traceback.
"""

from __future__ import annotations

import re
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Optional

import typer
from typer.core import TyperGroup

from . import verbosity
from .locations import HUB_ERRORS, one_line

DEFAULT_COMMAND = "convert"
# What a command reports as one line: bad input (UnsupportedModelError is a ValueError), files, the Hub.
USER_ERRORS = (ValueError, *HUB_ERRORS)


class _ConvertByDefault(TyperGroup):
    """Typer has no default command: a first word after the app's options that names no command is taken as
    MODEL."""

    def resolve_command(self, ctx, args):
        if args and not args[0].startswith("-") and args[0] not in self.commands:
            args = [DEFAULT_COMMAND, *args]
        return super().resolve_command(ctx, args)


app = typer.Typer(
    cls=_ConvertByDefault, add_completion=False, no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},  # every command's, through the context
    help="Convert attention to Multi-Head Linear Attention (MHLA). `mhla-convert MODEL` converts MODEL.",
)


def _print_version(value: bool) -> None:
    if value:
        from . import __version__

        typer.echo(f"mhla-convert {__version__}")
        raise typer.Exit()


@app.callback()
def app_options(
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print the version and exit."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Also the libraries' info logs and progress bars."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Results and errors only: no steps, no library warnings."),
) -> None:
    """Options for every command, given before it."""
    if verbose and quiet:
        _fail(ValueError("--verbose and --quiet contradict each other: give one"))
    verbosity.use(ctx, verbosity.VERBOSE if verbose else verbosity.QUIET if quiet else verbosity.NORMAL)


def _fail(error: Exception) -> None:
    typer.echo(f"error: {one_line(error)}", err=True)
    raise typer.Exit(2)


@contextmanager
def _step(message: str):
    """Say what a long step does and how long it took: nothing with -q, and with -v on lines of its own, as the
    libraries' logs and progress bars come between."""
    level = verbosity.level()
    say = typer.echo if level != verbosity.QUIET else lambda *args, **kwargs: None
    say(f"{message} ...", nl=level == verbosity.VERBOSE)
    again = f"{message}: " if level == verbosity.VERBOSE else " "
    start = time.perf_counter()
    try:
        yield
    except BaseException:
        say(f"{again}failed")
        raise
    say(f"{again}done ({time.perf_counter() - start:.1f} s)")


def _int_list(text: str | None, option: str, what: str, example: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(i) for i in text.replace(" ", "").split(",") if i]
    except ValueError:
        raise ValueError(f"{option} must be comma-separated {what} like {example}; got {text!r}") from None


def _radius(text: str) -> int | tuple[int, ...] | None:
    """--exact-radius: 'none', a whole number or one per axis ('1x0x0')."""
    if text.strip().lower() == "none":
        return None
    try:
        values = tuple(int(t) for t in text.strip().lower().split("x"))
    except ValueError:
        raise ValueError(f"--exact-radius must be a whole number like 1, one per axis like 1x0x0, or none; "
                         f"got {text!r}") from None
    return values[0] if len(values) == 1 else values


def _number_or_name(text: str) -> float | str:
    """A number where the text is one (a blend weight), else the text (a name)."""
    try:
        return float(text)
    except ValueError:
        return text


def _default_out(model: str) -> Path:
    return Path(re.sub(r"[^\w.-]+", "-", Path(model.rstrip("/")).name).strip("-") + "-mhla")


@app.command(DEFAULT_COMMAND)
def convert_command(
    model: str = typer.Argument(..., help="Alias (see `mhla-convert list`), tiny-* model, hub id or local directory."),
    ratio: float = typer.Option(1.0, help="Fraction of self-attention layers to convert, in [0, 1]."),
    strategy: str = typer.Option(
        "spread", help="Which layers for a ratio: spread, first, last or auto (least sensitive; needs --calibration)."),
    calibration: Optional[str] = typer.Option(
        None, help="Data to score layers on (--strategy auto) and to fit the weight outside an exact region: "
        "synthetic, latents, an image/video folder or text."),
    calibration_batches: int = typer.Option(4, help="With --calibration: how many examples (one per batch)."),
    fit_steps: int = typer.Option(0, help="--strategy auto: Adam steps fitting each layer to its original first."),
    layers: Optional[str] = typer.Option(
        None, help="Explicit layer indices, e.g. 1,4,7, or a layer type like sliding_attention (overrides --ratio)."),
    attention: str = typer.Option(
        "mhla", help="mhla; linear: plain linear attention (one block / window 1); local: the original's softmax "
        "cut to the exact region (a control)."),
    blocks: Optional[str] = typer.Option(
        None, help="Blocks per token-grid axis, e.g. 4x4 or 7x3x5 (default: the family's)."
    ),
    exact_radius: Optional[str] = typer.Option(
        None, help="Non-causal families: read the blocks within this many blocks of a query's own exactly, e.g. 1, "
        "or one per axis: 1x0x0 (default: the family's); 'none' turns it off."),
    mixing_init: Optional[str] = typer.Option(
        None, help="Mixing init: locality, uniform or a blend weight in [0, 1] (default: locality)."
    ),
    feature_map: Optional[str] = typer.Option(
        None, help="Feature map of the linear part: relu, elu or hedgehog (learned, trained by attention transfer; "
        "runs without the Triton kernels) (default: relu)."),
    retrieval_heads: Optional[str] = typer.Option(
        None, help="LMs: key heads that keep softmax over every earlier token in each converted layer, e.g. 0 or 0,3: "
        "long-range recall, at their share of a full KV cache (default: none)."),
    retrieval_share: float = typer.Option(
        0.0, help="LMs: share of the converted layers' key heads kept softmax, chosen on --calibration: those whose "
        "attention retrieves single tokens beyond the exact chunks most sharply (instead of --retrieval-heads)."),
    out: Optional[Path] = typer.Option(None, help="Where to save the converted model (default: ./<model>-mhla)."),
    pipeline: bool = typer.Option(
        False, help="Save a whole diffusers pipeline (the source pipeline's other components + the converted "
                    "transformer) that DiffusionPipeline.from_pretrained loads; needs a pipeline or tiny source."),
    dtype: Optional[str] = typer.Option(
        None, help="Load and save in this dtype: bf16, fp16 or fp32 (default: the source's)."),
    revision: Optional[str] = typer.Option(None, help="Hub revision of the base model."),
    subfolder: Optional[str] = typer.Option(
        None, help="The model's folder inside MODEL's directory or hub repo (default: the repo root, or transformer/ "
        "of a diffusers pipeline)."),
    config: Optional[str] = typer.Option(
        None, help="MODEL as one weights file: the directory or hub id holding its config (default: diffusers' "
        "guess from the weights)."),
    push: Optional[str] = typer.Option(None, help="Also push the result to this hub repo id."),
    private: bool = typer.Option(False, help="With --push: create the repo private."),
) -> None:
    """Convert MODEL's self-attention to MHLA, print the report, save it (and push it)."""
    verbosity.configure_libraries()
    from .calibrate import fits_far_weight
    from .convert import check_conversion, check_retrieval_share, convert
    from .experts import EXPERTS, convert_pipeline, load_experts
    from .io import check_save_target, save_pretrained
    from .locations import SOURCE_ATTR
    from .models import load_source, resolve, source_meta_model
    from .options import check_options
    from .pipelines import check_pipeline_source, save_pipeline
    from .placement import parse_dtype
    from .plan import AUTO_NEEDS_CALIBRATION

    try:  # check every option before a possibly long download
        named = layers is not None and layers.strip().isidentifier()  # a layer type
        options = dict(layers=layers.strip() if named else _int_list(layers, "--layers", "layer indices", "1,4,7"),
                       blocks=blocks, attention=attention)
        if mixing_init is not None:
            options["mixing_init"] = _number_or_name(mixing_init)
        if exact_radius is not None:
            options["exact_radius"] = _radius(exact_radius)
        if feature_map is not None:
            options["feature_map"] = feature_map
        if retrieval_heads is not None:
            options["retrieval_heads"] = _int_list(retrieval_heads, "--retrieval-heads", "key-head indices", "0,3")
        torch_dtype = parse_dtype(dtype)
        check_options(ratio=ratio, strategy=strategy, **options)
        auto = options["layers"] is None and strategy == "auto"
        if auto and calibration is None:
            raise ValueError(AUTO_NEEDS_CALIBRATION)
        if retrieval_share and calibration is None:
            raise ValueError("--retrieval-share chooses heads on calibration data: add --calibration")
        useless_calibration = ("--calibration ranks layers for --strategy auto (without --layers), fits the weight "
                               "outside an exact region (--attention mhla) and chooses retrieval heads "
                               "(--retrieval-share); drop it or add --strategy auto")
        if calibration is not None and not auto and attention != "mhla" and not retrieval_share:
            raise ValueError(useless_calibration)
        if fit_steps and not auto:
            raise ValueError("--fit-steps is for --strategy auto (without --layers); drop it or add --strategy auto")
        if fit_steps < 0:
            raise ValueError(f"--fit-steps must be >= 0; got {fit_steps}")
        if calibration_batches < 1:
            raise ValueError(f"--calibration-batches must be >= 1; got {calibration_batches}")
        target = out or _default_out(model)
        if not pipeline:
            check_save_target(target)
        source = resolve(model, revision=revision, subfolder=subfolder, config=config)
        if pipeline:
            check_pipeline_source(source)
        skeleton = source_meta_model(source)  # the options against the model's config, before its weights load
        if skeleton is not None:
            resolved = check_conversion(skeleton, ratio=ratio, strategy=strategy, **options)
            check_retrieval_share(retrieval_share, resolved, calibration)
            if calibration is not None and not (auto or retrieval_share or fits_far_weight(resolved, attention)):
                raise ValueError(useless_calibration)
        if calibration is not None:
            _check_calibration(skeleton, calibration)
        with _step(f"loading {source.describe()}"):  # a pipeline's experts (Wan2.2-A14B) all, to convert together
            experts = load_experts(source, torch_dtype) if pipeline and source.experts else None
            base = experts.models[EXPERTS[0]] if experts else load_source(source, torch_dtype=torch_dtype)
        if calibration is not None:
            with _step(f"reading {calibration_batches} calibration examples from {calibration}"):
                options["calibration"] = _calibration(base, calibration, calibration_batches)
        if retrieval_share:
            options["retrieval_share"] = retrieval_share
        with _step("converting"):
            report = (partial(convert_pipeline, experts) if experts else partial(convert, base))(
                ratio=ratio, strategy=strategy, fit_steps=fit_steps, progress=verbosity.level() != verbosity.QUIET,
                **options)
        if verbosity.level() != verbosity.QUIET:
            typer.echo(str(report))
        with _step(f"saving {'the pipeline ' if pipeline else ''}to {target}"):
            if pipeline:
                saved = save_pipeline(experts or base, source, target)
            else:  # the tokenizer etc. are part of the same atomic save
                saved = save_pretrained(base, target)
        companions = [] if pipeline else sorted(getattr(base, SOURCE_ATTR).get("companions") or {})
        typer.echo(f"saved: {saved}" + (f" (with the base model's {', '.join(companions)})" if companions else ""))
        if push:
            _push(saved, push, private)
    except USER_ERRORS as error:
        _fail(error)


def _check_calibration(skeleton, source: str) -> None:
    """--calibration's data, and its kind against the model's family where its config is known, before the weights
    load."""
    from .families import adapter_for_model
    from .train.calibration import calibration_data, check_calibration_kind
    from .train.errors import TrainError

    try:
        spec = calibration_data(source)
        if skeleton is not None:
            check_calibration_kind(adapter_for_model(skeleton), spec)
    except TrainError as error:
        raise ValueError(str(error)) from None


def _calibration(model, source: str, count: int) -> list[dict]:
    """`count` single-example batches of model inputs from `source` (fixed seed: the selection is repeatable)."""
    from .families import adapter_for_model
    from .locations import components_of
    from .train.calibration import calibration_batches, calibration_data
    from .train.errors import TrainError

    base = components_of(model)
    try:
        spec = calibration_data(source, batch_size=1, num_samples=count)
        return calibration_batches(adapter_for_model(model), model, spec, num_batches=count, seed=0, components=base)
    except TrainError as error:
        raise ValueError(str(error)) from None


def _push(directory: Path, repo_id: str, private: bool, **options) -> None:
    from .hub import push_to_hub

    with _step(f"pushing {directory} to {repo_id}"):
        url = push_to_hub(directory, repo_id, private=private, **options)
    typer.echo(f"pushed: {url}")


@app.command("list")
def list_command() -> None:
    """Show the model aliases, built-in tiny models and supported families."""
    from .catalog import ALIASES, FAMILIES, TINY_MODELS

    rows = [(alias, family, hub_id) for alias, (family, hub_id) in ALIASES.items()]
    rows += [(name, family, f"built in, random weights: {what}") for name, (family, what) in TINY_MODELS.items()]
    width = [max(len(r[c]) for r in rows) for c in range(2)]
    typer.echo("aliases:")
    for alias, family, where in rows:
        typer.echo(f"  {alias.ljust(width[0])}  {family.ljust(width[1])}  {where}")
    typer.echo("families:")
    for name, (library, classes) in FAMILIES.items():
        typer.echo(f"  {name.ljust(width[1])}  {library}: {', '.join(classes)}")


@app.command("push")
def push_command(
    directory: Path = typer.Argument(..., help="A checkpoint saved by mhla-convert."),
    repo_id: str = typer.Argument(..., help="Hub repo id, e.g. you/wan2.1-mhla."),
    private: bool = typer.Option(False, help="Create the repo private."),
    token: Optional[str] = typer.Option(None, help="Hub token (default: the one `hf auth login` stored)."),
    revision: Optional[str] = typer.Option(None, help="Branch to push to (created when missing)."),
    create_pr: bool = typer.Option(False, help="Open a pull request instead of committing to the branch."),
    adapter: Optional[Path] = typer.Option(
        None, help="Also push this LoRA adapter (DIR/adapter of a `merge: false` run) to its own repo, with the "
        "model as its base."),
    adapter_repo: Optional[str] = typer.Option(None, help="With --adapter: its repo id (default: REPO_ID-lora)."),
    force: bool = typer.Option(False, help="With --adapter: push it even if it was saved for another checkpoint."),
) -> None:
    """Push a saved MHLA checkpoint to the hub with a generated model card (and its LoRA adapter to its own repo)."""
    verbosity.configure_libraries()
    try:
        options = dict(token=token, revision=revision, create_pr=create_pr)
        if adapter is not None:
            options.update(adapter=adapter, adapter_repo_id=adapter_repo, force=force)
        elif adapter_repo or force:
            raise ValueError("--adapter-repo and --force are for --adapter: drop them or add --adapter DIR")
        _push(directory, repo_id, private, **options)
    except USER_ERRORS as error:
        _fail(error)


@app.command("demo")
def demo_command() -> None:
    """The main job on a tiny built-in Wan, offline: convert, check, save, reload, attention transfer, fine-tune,
    sample."""
    from .demo import run_demo

    verbosity.configure_libraries()
    try:
        run_demo()
    except USER_ERRORS as error:
        _fail(error)


@app.command("eval")
def eval_command(
    model: str = typer.Argument(..., help="Model to score: alias, tiny-* model, hub id, model or checkpoint dir."),
    reference: Optional[str] = typer.Option(None, help="The model to compare with: the base MODEL was converted from."),
    subfolder: Optional[str] = typer.Option(None, help="MODEL's folder inside its directory or hub repo."),
    reference_subfolder: Optional[str] = typer.Option(None, help="The reference's folder in its directory or repo."),
    data: str = typer.Option(..., help="synthetic, latents (.safetensors), an image/video folder, or text (LMs)."),
    out: Path = typer.Option(..., help="Directory for eval.json and summary.md (new, empty or a previous eval's)."),
    batch_size: int = typer.Option(4, help="Examples per batch."),
    num_batches: int = typer.Option(8, help="Batches scored: the first batch-size × num-batches examples, in order."),
    seed: int = typer.Option(0, help="Seeds the synthetic data, the diffusion noise and the passkey prompts."),
    device: Optional[str] = typer.Option(None, help="cuda, cpu, … (default: cuda when available)."),
    dtype: Optional[str] = typer.Option(None, help="Load in this dtype: bf16, fp16 or fp32."),
    timesteps: int = typer.Option(8, help="Diffusion: timesteps per batch, spread evenly over the training schedule."),
    passkey_lengths: str = typer.Option("256,1024,4096", help="LMs: passkey context lengths ('' for none)."),
    tasks: Optional[str] = typer.Option(None, help="LMs: lm-eval-harness tasks, e.g. hellaswag,arc_easy."),
    samples: Optional[bool] = typer.Option(None, "--samples/--no-samples",
                                           help="Diffusion: compare samples with the reference (default: on)."),
    metrics: str = typer.Option("loss", help="loss (always), and for diffusion with a reference fid and clip: "
                                "scores of the compared samples, e.g. loss,fid,clip."),
    fid_weights: Optional[Path] = typer.Option(
        None, help="fid: the local FID Inception weights file (pt_inception-2015-12-05-6726825d.pth)."),
    clip_model: Optional[str] = typer.Option(
        None, help="clip: a local CLIP model directory (or a hub id already in the local cache)."),
    components: Optional[str] = typer.Option(
        None, help="Where the tokenizer, VAE and text encoder come from (default: the base model MODEL records)."),
) -> None:
    """Score MODEL (and --reference) on held-out data with the family's training loss and more; print the gap."""
    verbosity.configure_libraries()
    from .evaluate import evaluate
    from .evaluate.report import table

    try:
        result = evaluate(model, data, reference, batch_size=batch_size, num_batches=num_batches, seed=seed,
                          out_dir=out, device=device, dtype=dtype, timesteps=timesteps, samples=samples,
                          passkey_lengths=_int_list(passkey_lengths, "--passkey-lengths", "token counts", "256,1024"),
                          tasks=_names(tasks), subfolder=subfolder, reference_subfolder=reference_subfolder,
                          metrics=_names(metrics), fid_weights=fid_weights, clip_model=clip_model,
                          data_options={"components": components} if components else None,
                          progress=verbosity.level() != verbosity.QUIET)
    except USER_ERRORS as error:
        _fail(error)
    typer.echo(table(result))
    typer.echo(f"wrote {out / 'eval.json'} and {out / 'summary.md'}")


def _names(text: str | None) -> list[str]:
    """A comma-separated list of names ('' or None: none)."""
    return [t for t in (text or "").replace(" ", "").split(",") if t]


def _register_training_commands() -> None:
    try:  # `finetune` and `sample` live in the training package, once it exists
        from .train.commands import register
    except ModuleNotFoundError as error:
        if error.name not in (f"{__package__}.train", f"{__package__}.train.commands"):
            raise  # a missing dependency of a present module is a real error
        return
    register(app)


_register_training_commands()


def main() -> None:
    app()
