"""Helpers shared by the Triton kernel modules."""
import triton


def fix_interpreter_loop_bounds() -> None:
    """CPU interpreter only (TRITON_INTERPRET=1): triton 3.6 turns a run-time scalar into a
    python int with ``int(array_of_one_element)``, which numpy >= 2.4 rejects, so a loop like
    ``range(tile_lo, tile_hi)`` over loaded values fails. Use ``.item()`` instead, for the
    duration of each interpreted launch (the interpreter restores its patches afterwards)."""
    if not triton.knobs.runtime.interpret:
        return
    try:
        from triton.runtime import interpreter
        original = interpreter._patch_lang_tensor
    except (ImportError, AttributeError):
        return
    if getattr(original, "_pagoda_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patched._pagoda_fixed = True
    interpreter._patch_lang_tensor = patched

