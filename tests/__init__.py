"""zerostack's tests: a package, so that they and their helpers import absolutely
(``tests.support.ranks``), in pytest and in the ranks it starts."""
