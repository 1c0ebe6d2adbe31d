"""The pipeline: source -> engines/<name>/ (export, build, check, manifest). It sits above export/, build/ and
runtime/ and is the only part of specrt that uses all three. Its modules, by role:

  orchestrate   the request, its inputs key, the export cache, and writing the set (make_engine_set)
  engines       one target or draft engine: built with onnxruntime in the build cache, checked, its entry
  checks        parity with PyTorch, width-exactness, the logit screen's bound
  tree_sizing   the Medusa engine and its tree, sized from the target's measured pass costs
  buildcache    the build cache's lock, listing and pruning, and moving a set into place
  runtime_link  the one place the pipeline opens a runtime/ engine
"""

from .buildcache import LEFTOVER_AGE_S, CacheEntry, cache_entries, prune_cache
from .checks import check_engine, check_screen
from .orchestrate import (EXPORT_FORMAT, MIN_CONTEXT, EngineSetRequest, check_destination, default_eagle,
                          default_heads, make_engine_set, source_name)
from .tree_sizing import MIN_WIDTH_SLOPE, PRIOR_WIDTH_SLOPE, TREE_COSTS, time_passes

__all__ = ["CacheEntry", "EXPORT_FORMAT", "EngineSetRequest", "LEFTOVER_AGE_S", "MIN_CONTEXT", "MIN_WIDTH_SLOPE",
           "PRIOR_WIDTH_SLOPE", "TREE_COSTS", "cache_entries", "check_destination", "check_engine", "check_screen",
           "default_eagle", "default_heads", "make_engine_set", "prune_cache", "source_name", "time_passes"]
