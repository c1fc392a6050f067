/**
 * Node's timers count milliseconds in a signed 32-bit integer: a longer delay fires after 1 ms
 * instead (TimeoutOverflowWarning), so "a huge value to turn it off" would fire at once. The
 * service's settings (config.ts) and the client's time limits are held to it.
 */
export const MAX_TIMER_MS = 2 ** 31 - 1;
