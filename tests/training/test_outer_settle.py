"""A resume keeps the run's own outer lr and momentum across a change of the defaults (issue 24 item 4's new
defaults: lr 0.7, momentum 0.5; before them momentum 0.9): `flodl_mpi.training.train.settle_outer`."""

def test_a_resume_names_the_outer_settings_it_keeps():
    """training.train.settle_outer: the config with the values settled, and a line only where a resume keeps values
    other than today's defaults; --outer avg is left as it is."""
    import dataclasses

    from flodl_mpi.config import TrainConfig
    from flodl_mpi.training.train import settle_outer

    class Saved:  # the resumed checkpoint: only its saved config is read
        def __init__(self, **config):
            self.config = config

        def saved_config(self):
            return {**TrainConfig().to_dict(), **self.config}

    cfg = TrainConfig(outer="nesterov", policy="window", window=4)
    new, note = settle_outer(cfg, None)
    assert (new.outer_lr, new.outer_momentum, note) == (0.7, 0.5, None)
    assert dataclasses.replace(new, outer_lr=None, outer_momentum=None) == cfg  # nothing else changed
    kept, note = settle_outer(cfg, Saved(outer="nesterov", outer_lr=None, outer_momentum=None))
    assert (kept.outer_lr, kept.outer_momentum) == (0.7, 0.9)
    assert note == ("--outer nesterov: lr 0.7, momentum 0.9, the run's own (today's defaults: lr 0.7, momentum 0.5; "
                    "--outer-lr and --outer-momentum change them)")
    same, note = settle_outer(cfg, Saved(outer="nesterov", outer_lr=0.7, outer_momentum=0.5))
    assert (same.outer_lr, same.outer_momentum, note) == (0.7, 0.5, None)
    given, note = settle_outer(dataclasses.replace(cfg, outer_lr=0.2, outer_momentum=0.1),
                               Saved(outer="nesterov", outer_lr=None, outer_momentum=None))
    assert (given.outer_lr, given.outer_momentum, note) == (0.2, 0.1, None)
    plain = TrainConfig()
    assert settle_outer(plain, None) == (plain, None)
