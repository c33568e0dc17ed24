"""Publish a trained head to the Hugging Face Hub with a model card, in one command.

    python scripts/publish.py outputs/eagle3-demo/head --repo-id me/eagle3-demo --dry-run publish-preview
    python scripts/publish.py outputs/eagle3-demo/head --repo-id me/eagle3-demo --benchmark outputs/benchmark

Uploads what loading reads (config.json, model.safetensors, tree.json, a Medusa-2 adapter/) and a
README.md card built from the run's config.yaml / metrics.json (beside the head directory) and, with
--benchmark, scripts/benchmark.py's tables and plots. Needs a token (`hf auth login` or HF_TOKEN)
unless --dry-run, which writes the exact folder and uploads nothing. Load the published head with
`SpeculativeGenerator.from_pretrained(TARGET, "me/eagle3-demo")`.
"""

from __future__ import annotations

import argparse
import sys

from spechead.heads.hub import prepare_upload, upload_to_hub


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("head_dir", help="the head directory (a training run's OUTPUT_DIR/head)")
    p.add_argument(
        "--repo-id", required=True, help="NAMESPACE/NAME of the Hub model repo (created if needed)"
    )
    p.add_argument(
        "--private",
        action="store_true",
        help="create the repo private (an existing repo keeps its visibility)",
    )
    p.add_argument("--revision", default=None, help="branch to commit to (created if needed; default main)")
    p.add_argument(
        "--benchmark", default=None, metavar="DIR", help="scripts/benchmark.py --out folder to include"
    )
    p.add_argument(
        "--license", default=None, help="license id for the card metadata (e.g. apache-2.0); omitted if unset"
    )
    p.add_argument(
        "--base-model", default=None, help="Hub id of the target when it was trained from a local path"
    )
    p.add_argument(
        "--dry-run", default=None, metavar="OUT_DIR", help="write the folder to OUT_DIR, upload nothing"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    card = {"benchmark_dir": args.benchmark, "license": args.license, "base_model": args.base_model}
    try:
        upload = prepare_upload(args.head_dir, repo_id=args.repo_id, revision=args.revision, **card)
        for note in upload.notes:
            print(f"note: {note}")
        if args.dry_run is not None:
            out = upload.write(args.dry_run)
            print(
                f"dry run: wrote {len(upload.paths())} files to {out}, uploaded nothing: {', '.join(upload.paths())}"
            )
            return 0
        url = upload_to_hub(upload, args.repo_id, private=args.private, revision=args.revision)
    except (ValueError, OSError) as err:  # HeadError is a ValueError
        print(f"error: {str(err).strip().splitlines()[0]}", file=sys.stderr)
        return 2
    print(f"published {args.head_dir} to {args.repo_id}: {url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
