/**
 * The outside reference for the sync path: a bare fastify hello-world (no hooks,
 * plugins or logging), in its own process. `node dist/bench/hello.js <port>`; stops on SIGTERM.
 */
import Fastify from 'fastify';

const app = Fastify();
app.get('/', async () => ({ hello: 'world' }));
await app.listen({ host: '127.0.0.1', port: Number(process.argv[2]) });
process.once('SIGTERM', () => void app.close());
