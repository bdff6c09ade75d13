"""A job whose advantage stage fails at step 2 (the error a user's change to the algorithm would raise).

Args: RECIPE OUTPUT_DIR [overrides...]. The exception leaves the script as Python prints it: the test checks that
it is the only traceback on stderr (shutdown after the error must stay silent).
"""

import sys


def main() -> None:
    recipe, out, *overrides = sys.argv[1:]
    from verl_mega.config import load_config
    from verl_mega.train import train
    from verl_mega.trainer.rl_trainer import RLTrainer

    original = RLTrainer._advantage

    def failing(self, *args):
        if self.actor.engine.version >= 1:
            raise RuntimeError("advantage stage failed on purpose")
        return original(self, *args)

    RLTrainer._advantage = failing
    train(load_config(recipe, [f"trainer.output_dir={out}", *overrides]))


if __name__ == "__main__":
    main()
