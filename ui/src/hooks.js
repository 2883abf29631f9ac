// Hooks the views share.

import { useEffect, useRef, useState } from "preact/hooks";

/**
 * A destructive action asked twice: `[armed, confirm]`. `confirm()` on a first click arms it for
 * `ms` and returns false; on a second click while armed it disarms and returns true. The armed
 * state is also kept in a ref, so two clicks before a redraw still count as two.
 */
export function useConfirm(ms) {
  const [armed, setArmed] = useState(false);
  const now = useRef(false);
  const timer = useRef(null);
  useEffect(() => () => clearTimeout(timer.current), []);
  const set = (on) => {
    now.current = on;
    setArmed(on);
  };
  const confirm = () => {
    clearTimeout(timer.current);
    if (now.current) {
      set(false);
      return true;
    }
    set(true);
    timer.current = setTimeout(() => set(false), ms);
    return false;
  };
  return [armed, confirm];
}
