"""``omni-studio history ls|show|export|import``: the run store from the terminal."""

from __future__ import annotations

import argparse
from pathlib import Path

from studio.errors import UserError
from studio.startup.settings import StudioSettings


def cmd_history(args: argparse.Namespace, settings: StudioSettings) -> int:
    """``history ls|show|export|import``: the run store from the terminal."""
    import json

    from studio.store import (
        AmbiguousRunId,
        BundleError,
        RunFilter,
        RunNotFound,
        StoreError,
        export_bundle,
        import_bundle,
        open_store,
    )
    from studio.store.object_files import open_output_files
    from studio.store.terminal import format_run_detail, format_run_table

    try:
        files = open_output_files(settings.data_dir, settings.outputs, settings.outputs_options)
        store = open_store(settings.db_url, settings.data_dir, files)
    except StoreError as exc:
        raise UserError(str(exc)) from exc
    try:
        action = args.history_command
        if action == "ls":
            try:
                selection = RunFilter(
                    search=args.search, status=args.status, output_kind=args.output, user=args.user
                )
                runs = store.list_runs(selection, limit=args.limit)
                total = store.count_runs(selection)
            except ValueError as exc:  # an unknown --status or --output
                raise UserError(str(exc)) from exc
            print(
                json.dumps([r.to_dict() for r in runs], indent=2)
                if args.json
                else format_run_table(runs, total)
            )
        elif action == "show" and args.png is not None:
            from studio.cli.recipe import show_file_runs

            if args.run_id is not None:
                raise UserError("give a run ID or --png FILE.png, not both")
            return show_file_runs(args, store)
        elif action == "show":
            if args.run_id is None:
                raise UserError("give a run ID (or --png FILE.png)")
            try:
                run = store.get_run(store.resolve_run_id(args.run_id))
            except (RunNotFound, AmbiguousRunId) as exc:
                raise UserError(str(exc)) from exc
            print(json.dumps(run.to_dict(), indent=2, default=str) if args.json else format_run_detail(run))
        elif action == "export":
            count = export_bundle(store, Path(args.file))
            print(f"exported {count} run{'s' if count != 1 else ''} to {args.file}")
        elif action == "import":
            try:
                result = import_bundle(store, Path(args.file))
            except BundleError as exc:
                raise UserError(str(exc)) from exc
            print(
                f"imported {result.imported} run{'s' if result.imported != 1 else ''}, "
                f"skipped {result.skipped} already present"
            )
        elif action == "prune":
            from studio.store.terminal import prune_history

            try:
                print(prune_history(store, args))
            except ValueError as exc:  # no filter without --all, an unknown --status
                raise UserError(str(exc)) from exc
        return 0
    finally:
        store.close()
