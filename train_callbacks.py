"""callbacks (spec: AsyncGRPOTrainer's `callbacks`, a list of transformers TrainerCallback) and
`trainer.state`, in a minimal form: rank 0 calls these events of each callback, with transformers'
own TrainerState and TrainerControl and the arguments TrainerCallback's methods take:

    on_train_begin(args, state, control)               the rollout process is up
    on_step_end(args, state, control)                  after each optimizer step (and weight sync)
    on_log(args, state, control, logs=line)            each metrics.jsonl line
    on_save(args, state, control)                      after each checkpoint-N/
    on_train_end(args, state, control)                 after the last step

    class StopAt(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs["reward"] > 0.9:
                control.should_training_stop = True   # every rank stops after this step

state.global_step and state.log_history (every logged line) are kept on rank 0 whether or not
callbacks are given; AsyncGRPOTrainer.state is this state.

Departures from the spec, one line each:
- Only these five events, on rank 0 only; control.should_training_stop is the one flag honoured.
- No default callbacks (progress, printing): MetricsLog does that, so remove_callback has none.
"""
EVENTS = ("on_train_begin", "on_step_end", "on_log", "on_save", "on_train_end")


class Hooks:
    """The callbacks, the TrainerState they read and the TrainerControl they may set."""

    def __init__(self, callbacks: list, config):
        from transformers import TrainerControl, TrainerState
        self.callbacks = list(callbacks)
        self.config = config
        self.state = TrainerState(max_steps=config.max_steps,
                                  num_train_epochs=config.num_train_epochs,
                                  logging_steps=config.logging_steps, save_steps=config.save_steps)
        self.control = TrainerControl()

    def event(self, name: str, global_step: int, **kwargs) -> None:
        """Call `name` on every callback that has it, with the state at global_step."""
        self.state.global_step = global_step
        if name == "on_log":
            self.state.log_history.append(dict(kwargs["logs"]))
        for callback in self.callbacks:
            method = getattr(callback, name, None)
            if method is not None:
                method(self.config, self.state, self.control, **kwargs)

    @property
    def should_stop(self) -> bool:
        return self.control.should_training_stop
