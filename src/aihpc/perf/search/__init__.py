"""The search over plans: enumerate the valid plans of a run spec (``candidates``), price them as
arrays with the step model and rank those that fit (``ranking``)."""

from aihpc.perf.search.ranking import Rejected, SearchResult, candidate_plans, search, search_plans

__all__ = ["Rejected", "SearchResult", "candidate_plans", "search", "search_plans"]
