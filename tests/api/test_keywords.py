"""flodl_mpi.api.keywords: the unknown-keyword line of fit() and Averager() (issue 26 item 9), hand-worked."""

from flodl_mpi.api.keywords import unknown_keywords


def test_each_unknown_keyword_gets_its_closest_name_and_the_line_lists_every_name():
    line = unknown_keywords("Averager()", ["windw", "zzz", "polcy"], ["window", "policy", "gamma", "window"])
    assert line == ("Averager() got unknown option(s) polcy (did you mean policy?), windw (did you mean window?), "
                    "zzz; the options it takes by name are gamma, policy, window")
