"""Models from the Hugging Face Hub: `org/name` or `org/name@revision`, downloaded through
huggingface_hub into its own cache, or taken from that cache alone when the user is offline
(`HF_HUB_OFFLINE=1` or `--offline`). `HF_ENDPOINT` and `HF_TOKEN` work as everywhere in the
Hugging Face tools; a progress bar shows on a terminal.

Interrupted downloads: huggingface_hub resumes a connection that drops mid-file in place (an HTTP
Range request, up to 5 times without progress). When it gives up, the files already complete stay
in the cache, the half-written one is deleted (each download writes a temporary file that is
renamed into place only when complete), and the next run fetches what is missing. A snapshot is
used only once every file of it is there.

Every failure is a ValueError that says what to do: a repository that does not exist, a gated
or private one (log in or pass a token), a token the Hub refuses, a revision that does not
exist, a download that broke off (run again), or the model offline and not cached.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import httpx2
from tqdm.auto import tqdm

if TYPE_CHECKING:
    from huggingface_hub.errors import HfHubHTTPError

log = logging.getLogger(__name__)

TRUST_ENV = "ACCELAB_TRUST_REMOTE_CODE"
HUB_REF = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(@(?P<revision>[\w./-]+))?$")


def parse_ref(text: str) -> tuple[str, str | None] | None:
    """("org/name", "revision" or None) for a Hub reference, else None."""
    match = HUB_REF.match(text)
    return (match["repo"], match["revision"]) if match else None


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "on", "true", "yes")


def snapshot(repo: str, revision: str | None = None) -> Path:
    """The local directory of `repo` at `revision` (default: main), downloaded when needed."""
    from huggingface_hub import errors as hub_errors, snapshot_download

    where = f"{repo}@{revision}" if revision else repo
    if offline():
        try:
            return Path(snapshot_download(repo, revision=revision, local_files_only=True))
        except hub_errors.IncompleteSnapshotError as err:
            raise ValueError(
                f"{where} is only partly in the local Hugging Face cache ({_cache()}): a download of it broke off, "
                "and downloads are off (HF_HUB_OFFLINE or --offline); run once online to finish it"
            ) from err
        except (hub_errors.LocalEntryNotFoundError, FileNotFoundError, OSError) as err:
            raise ValueError(
                f"{where} is not in the local Hugging Face cache ({_cache()}), and downloads are off (HF_HUB_OFFLINE "
                f"or --offline); run once online to download it, or unset HF_HUB_OFFLINE"
            ) from err
    log.info("downloading %s from %s (what is already in the cache is kept)", where, _endpoint())
    try:
        path = snapshot_download(repo, revision=revision, tqdm_class=_progress_bar_class())
    except Exception as err:
        explained = _explain(err, repo, revision)
        if explained is None:
            raise
        raise explained from err
    return Path(path)


def _progress_bar_class() -> type | None:
    """tqdm's own bar on a terminal, else huggingface_hub's default (which honours
    HF_HUB_DISABLE_PROGRESS_BARS, set by `accelab.quiet`). enable_progress_bars() cannot undo
    that variable once huggingface_hub is imported (the variable has priority), but a tqdm class
    that is not huggingface_hub's own is shown as is."""
    if not sys.stderr.isatty():
        return None

    return tqdm


def _explain(err: Exception, repo: str, revision: str | None) -> ValueError | None:
    """The user's next step for an error of snapshot_download, or None for one it does not know.

    Where huggingface_hub 2.x raises what: the repository API call (/api/models/{repo}/revision/{rev})
    gives RepositoryNotFoundError for X-Error-Code RepoNotFound, which the Hub sends with 404, and
    with 401 to a caller without a token (missing and private repositories look the same then);
    RevisionNotFoundError for X-Error-Code RevisionNotFound. A gated repository's files answer
    401/403 with X-Error-Code GatedRepo: GatedRepoError (a RepositoryNotFoundError). A token the Hub
    rejects is a plain HfHubHTTPError 401. A connection that breaks mid-file is resumed in place
    (HTTP Range) a few times, then surfaces as httpx2's TransportError (RemoteProtocolError, ReadError,
    a timeout), which is neither an OSError nor an HfHubHTTPError; the half-written file is deleted.
    A Hub that cannot be reached at all, or answers 5xx, becomes LocalEntryNotFoundError. Any of
    these is raised only when the snapshot is not in the cache: a cached one is returned instead.
    """
    from huggingface_hub import errors as hub_errors

    where, endpoint = (f"{repo}@{revision}" if revision else repo), _endpoint()
    if isinstance(err, hub_errors.HfHubHTTPError) and (access := _access_error(err, repo, where)) is not None:
        return access
    if isinstance(err, hub_errors.RevisionNotFoundError):
        return ValueError(
            f"{repo} has no revision {revision!r} on the Hub at {endpoint}; give a branch, tag or "
            "commit that exists (org/name@revision)"
        )
    if isinstance(err, PermissionError):
        return ValueError(
            f"cannot write the Hugging Face cache ({err}); set HF_HOME or HF_HUB_CACHE to a directory you may write"
        )
    if isinstance(err, (httpx2.TransportError, hub_errors.HfHubHTTPError)) or (
        isinstance(err, OSError) and not isinstance(err, hub_errors.LocalEntryNotFoundError)
    ):  # a connection dropped mid-file (after huggingface_hub's own resumes), a timeout, a 5xx, a short file
        return ValueError(
            f"downloading {where} from {endpoint} broke off ({type(err).__name__}: {_first_line(err)}); run the "
            "same command again: the files already complete are kept and the rest downloads again; a half-written "
            "file is never used"
        )
    if isinstance(err, hub_errors.LocalEntryNotFoundError):
        return ValueError(
            f"could not reach the Hub at {endpoint} for {where} ({_first_line(err.__cause__ or err)}), and it is "
            f"not in the local Hugging Face cache ({_cache()}): check the network, a proxy or HF_ENDPOINT; or "
            "copy the model's directory here and pass its path"
        )
    return None


def _access_error(err: HfHubHTTPError, repo: str, where: str) -> ValueError | None:
    """Not found, gated, private, disabled or a refused token: what to check or how to log in."""
    from huggingface_hub import errors as hub_errors

    endpoint, response = _endpoint(), err.response
    status = response.status_code
    sent_token = "authorization" in response.request.headers
    login = "log in with `hf auth login` or set HF_TOKEN to a token that may read it"
    if isinstance(err, hub_errors.GatedRepoError):
        return ValueError(
            f"{where} is gated on the Hub at {endpoint}: accept its terms on {endpoint}/{repo}, then "
            + ("use a token of the account that did (HF_TOKEN or `hf auth login`)" if sent_token else login)
        )
    if isinstance(err, hub_errors.RepositoryNotFoundError):
        if status == 401 and not sent_token:
            return ValueError(
                f"{where} was not found on the Hub at {endpoint}, or it is private or gated and you are not logged "
                f"in (the Hub answers 401 to both): check the name (org/name); if it is private, {login}"
            )
        return ValueError(
            f"{where} was not found on the Hub at {endpoint} ({status}): check the name (org/name); if it is "
            "private, use a token of an account that may read it (HF_TOKEN or `hf auth login`)"
        )
    if isinstance(err, hub_errors.DisabledRepoError):
        return ValueError(f"{where} is disabled on the Hub at {endpoint} (by its owner or the Hub); pick another model")
    if status in (401, 403) and sent_token:
        return ValueError(
            f"the Hub at {endpoint} refused the token sent for {where} ({status}: {_first_line(err)}): the token in "
            "HF_TOKEN or from `hf auth login` is wrong, expired or may not read this repository; fix HF_TOKEN or "
            "log in again"
        )
    if status in (401, 403):
        return ValueError(f"the Hub at {endpoint} refused access to {where} ({status}): {login}")
    return None


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0][:200]


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


# where transformers looks for `auto_map`: the model's config, and the tokenizer's or processor's
REMOTE_CODE_FILES = ("config.json", "tokenizer_config.json", "preprocessor_config.json", "processor_config.json")


def needs_remote_code(directory: Path) -> str | None:
    """The file whose `auto_map` points at Python code in the model's repository, or None."""
    for name in REMOTE_CODE_FILES:
        try:
            if json.loads((directory / name).read_text()).get("auto_map"):
                return name
        except (OSError, ValueError, AttributeError):  # absent, not JSON, not an object
            continue
    return None


def trust_remote_code_default() -> bool:
    """`accelab --trust-remote-code ...` (or ACCELAB_TRUST_REMOTE_CODE=1): off unless asked."""
    return os.environ.get(TRUST_ENV, "").lower() in ("1", "true", "yes")


def check_remote_code(directory: Path, name: str, trust_remote_code: bool) -> None:
    if (where := needs_remote_code(directory)) is not None and not trust_remote_code:
        raise ValueError(
            f"{name} runs Python code from its repository (its {where} has auto_map); accelab does not run "
            "downloaded code unless asked: read that code, then pass --trust-remote-code "
            f"(`accelab --trust-remote-code bench {name} ...`, or {TRUST_ENV}=1)"
        )


def _cache() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE
