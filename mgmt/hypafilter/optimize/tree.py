"""The decision trees of `hypafilter optimize` (HiTables): analysis.dtree, where strategy tree's chains (analysis.trees)
build them too."""

from hypafilter.analysis.dtree import *  # noqa: F403
