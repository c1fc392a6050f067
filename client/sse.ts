import { createParser } from 'eventsource-parser';

/** One Server-Sent Event: its name and its data. */
export interface ServerEvent {
  readonly event: string;
  readonly data: string;
}

/** Parses a text/event-stream body into events as they arrive (eventsource-parser; comments and keep-alives skipped). */
export async function* readServerEvents(body: AsyncIterable<Uint8Array>): AsyncGenerator<ServerEvent> {
  const decoder = new TextDecoder();
  const ready: ServerEvent[] = [];
  const parser = createParser({ onEvent: ({ event, data }) => ready.push({ event: event ?? 'message', data }) });
  for await (const piece of body) {
    parser.feed(decoder.decode(piece, { stream: true }));
    yield* ready.splice(0);
  }
}
