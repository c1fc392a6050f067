/** One Server-Sent Event: its name and its data. */
export interface ServerEvent {
  readonly event: string;
  readonly data: string;
}

/** Parses a text/event-stream body into events as they arrive (comments and keep-alives skipped). */
export async function* readServerEvents(body: AsyncIterable<Uint8Array>): AsyncGenerator<ServerEvent> {
  const decoder = new TextDecoder();
  let buffer = '';
  for await (const piece of body) {
    buffer += decoder.decode(piece, { stream: true });
    let end: number;
    while ((end = buffer.indexOf('\n\n')) !== -1) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let event = 'message';
      const data: string[] = [];
      for (const line of block.split('\n')) {
        if (line.startsWith('event:')) event = line.slice(6).trim();
        else if (line.startsWith('data:')) data.push(line.slice(5).replace(/^ /, ''));
      }
      if (data.length > 0) yield { event, data: data.join('\n') };
    }
  }
}
