"""Artifacts on disk: the names callers import from here, each kept in the module of its job.

- :mod:`serl_cli.artifacts.writes`: files written whole (``atomic_write_text``, ``write_json``,
  ``write_jsonl``, ``append_jsonl``, ``save_figure``, ``torch_save``; ``torch_load`` reads a torch
  file back as data only), a failed write as one line (``write_failed``, ``torch_write_failed``),
  the output folders writes go into (``check_output_dir``, ``make_dir``, ``prepare_output``),
  files' modes (``follow_umask``), digests (``file_sha256``, ``digest_files``, ``check_digests``),
  and what killed writers leave (``clear_debris``)
- :mod:`serl_cli.artifacts.jsonl`: JSON and JSONL read strictly (``read_json``, ``iter_jsonl``,
  ``count_jsonl``, ``truncate_jsonl``) and record files kept gzipped (``stored``,
  ``read_stored_bytes``, ``gzip_file``)
- :mod:`serl_cli.artifacts.manifest`: the run's manifest (``new_manifest``, ``load_manifest``,
  ``mark_stage``)
- :mod:`serl_cli.artifacts.journal`: journals, which make a killed stage resumable
  (``begin_resumable``, ``start_journal``, ``append_journal``, ``read_journal``)
- :mod:`serl_cli.artifacts.plain_config`: configs as plain data (``to_plain``, ``json_copy``) and
  the settings two differ in (``differences``, ``first_difference``, ``differences_text``,
  ``difference_text``)

The run lock, which keeps two processes from writing one run directory, is in
:mod:`serl_cli.artifacts.runlock`. New code may import from the modules above directly.
"""

from __future__ import annotations

# the module the atomic writes take their temporary files from, as the disk-full tests reach it
import tempfile as tempfile

from serl_cli.artifacts.journal import append_journal as append_journal
from serl_cli.artifacts.journal import begin_resumable as begin_resumable
from serl_cli.artifacts.journal import read_journal as read_journal
from serl_cli.artifacts.journal import start_journal as start_journal
from serl_cli.artifacts.jsonl import count_jsonl as count_jsonl
from serl_cli.artifacts.jsonl import gzip_file as gzip_file
from serl_cli.artifacts.jsonl import iter_jsonl as iter_jsonl
from serl_cli.artifacts.jsonl import read_json as read_json
from serl_cli.artifacts.jsonl import read_stored_bytes as read_stored_bytes
from serl_cli.artifacts.jsonl import stored as stored
from serl_cli.artifacts.jsonl import truncate_jsonl as truncate_jsonl
from serl_cli.artifacts.manifest import load_manifest as load_manifest
from serl_cli.artifacts.manifest import mark_stage as mark_stage
from serl_cli.artifacts.manifest import new_manifest as new_manifest
from serl_cli.artifacts.plain_config import difference_text as difference_text
from serl_cli.artifacts.plain_config import differences as differences
from serl_cli.artifacts.plain_config import differences_text as differences_text
from serl_cli.artifacts.plain_config import first_difference as first_difference
from serl_cli.artifacts.plain_config import json_copy as json_copy
from serl_cli.artifacts.plain_config import to_plain as to_plain
from serl_cli.artifacts.writes import append_jsonl as append_jsonl
from serl_cli.artifacts.writes import atomic_write_text as atomic_write_text
from serl_cli.artifacts.writes import check_digests as check_digests
from serl_cli.artifacts.writes import check_output_dir as check_output_dir
from serl_cli.artifacts.writes import clear_debris as clear_debris
from serl_cli.artifacts.writes import digest_files as digest_files
from serl_cli.artifacts.writes import file_sha256 as file_sha256
from serl_cli.artifacts.writes import follow_umask as follow_umask
from serl_cli.artifacts.writes import make_dir as make_dir
from serl_cli.artifacts.writes import prepare_output as prepare_output
from serl_cli.artifacts.writes import save_figure as save_figure
from serl_cli.artifacts.writes import torch_load as torch_load
from serl_cli.artifacts.writes import torch_save as torch_save
from serl_cli.artifacts.writes import torch_write_failed as torch_write_failed
from serl_cli.artifacts.writes import write_failed as write_failed
from serl_cli.artifacts.writes import write_json as write_json
from serl_cli.artifacts.writes import write_jsonl as write_jsonl
