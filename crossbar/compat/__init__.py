"""The one place for each library whose private names crossbar touches.

One module per library (:mod:`crossbar.compat.twisted`, ...), each with the versions it
was checked against (the same bound as ``pyproject.toml``'s), a start-up check that
falls back to the library's own behaviour when its internals are not as expected, and a
test (``tests/test_compat_*.py``) that names what moved. The bottom floor of the
package: the wings import it; it imports none of them.
"""
