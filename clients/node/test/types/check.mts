// Compiled (not run) by test.sh: the ESM types of the installed package.
import {
	idempotent, idempotentJob, currentJob, expressIdempotency, fastifyIdempotency, rawBody, idempotencyContext,
	defaultStorePolicy, InProgressError, KeyLostError, MisconfiguredError, ExpiredError, type IdempotencyContext,
	type JsonValue, completer, type Completer, type CompletedResponse,
} from 'pg-idempotency';
import express from 'express';
import Fastify from 'fastify';
import pg from 'pg';

const pool = new pg.Pool();

const r = await idempotent(pool, { key: 'msg-1', request: { amount: 1 }, lease: 10 },
	async ({ token, attempt, signal }) => {
		signal.throwIfAborted();
		return { charged: true, token, attempt };
	});
if (r.replayed) {
	const charged: boolean = r.value.charged;
	const none: null = r.attempt;
	void charged; void none;
} else {
	const attempt: number = r.attempt;
	const token: string = r.token;
	void attempt; void token;
}

const app = express();
app.use(express.json({ verify: rawBody }));
const idem = expressIdempotency({
	pool, scope: (req) => String(req.headers['x-tenant'] ?? ''), cache: { max: 100 },
	key: (req) => (typeof req.headers['x-message-id'] === 'string' ? req.headers['x-message-id'] : null),
	canonicalJson: true, maxBodySize: 65536, storeServerErrors: true, failedWrites: 'rollback',
	storeHeaders: ['x-cost'], retryAfterMax: 10, handlerTimeout: 60,
});
const untimed = expressIdempotency({ pool, handlerTimeout: null });
void untimed;
const policy: 'succeeded' | 'failed' | 'release' = defaultStorePolicy(503, { storeServerErrors: true });
void policy;
app.post('/payments', idem, (req, res) => {
	const ctx: IdempotencyContext | undefined = req.idempotency;
	res.status(201).json({ key: ctx?.key, attempt: ctx?.attempt });
});
app.post('/orders', idem.transactional, async (req, res) => {
	const ctx = idempotencyContext(req)!;
	await ctx.client!.query('SELECT 1');
	if (ctx.phase !== 'a_done')
		await ctx.checkpoint('a_done');
	res.status(201).json({ ok: true });
});

app.use(idem.errors);

const f = Fastify();
await f.register(fastifyIdempotency, { pool, storePolicy: (s) => (s >= 500 ? 'release' : 'succeeded'), remember: 86400 });
f.post('/x', async (request) => ({ key: idempotencyContext(request as any)?.key }));
const payouts = expressIdempotency({
	pool, remember: 30 * 86400,
	onExpired: ({ key, status, responseCode }) => {
		const outcome: 'succeeded' | 'failed' = status;
		const code: number | null = responseCode;
		void key; void outcome; void code;
	},
});
void payouts;

const resumed = await idempotent(pool, { key: 'order-1', sessionBound: true },
	async ({ phase, phaseData, checkpoint }) => {
		const client = await pool.connect();
		if (phase === null)
			await checkpoint('charge_created', { charge: 'ch_1' }, { client });
		client.release();
		const data: JsonValue | null = phaseData;
		return data;
	});
void resumed;

const chargeOrder = idempotentJob(pool, { key: (orderId) => orderId, request: (_orderId, amount) => ({ amount }), lease: 10 },
	async (orderId: string, amount: number) => {
		const job = currentJob();
		return { orderId, amount, token: job?.token ?? null };
	});
const charged: { orderId: string; amount: number; token: string | null } = await chargeOrder('o-1', 5);
void charged;
const unscoped = idempotentJob(pool, { key: (id: string) => id, scope: '' }, async (id: string) => id.length);
void unscoped;

try {
	await idempotent(pool, { key: 'k', remember: 7 * 86400, onExpired: (e) => console.log(e.status) }, () => 1);
} catch (err) {
	if (err instanceof InProgressError) {
		const s: number = err.retryAfter;
		void s;
	}
	if (err instanceof KeyLostError)
		console.log(err.key);
	if (err instanceof ExpiredError) {
		const was: 'succeeded' | 'failed' = err.status;
		const code: number | null = err.responseCode;
		console.log(err.key, err.scope, was, code);
	}
	if (err instanceof MisconfiguredError)
		console.log(err.message);
}

const kept = expressIdempotency({ pool, keepRequest: true });
void kept;
await idempotent(pool, { key: 'order-2', request: { amount: 5 }, keepRequest: true },
	async ({ request, token }) => ({ request, token }));
const orders: Completer = completer({
	pool, scope: 'orders', concurrency: 4, lease: 30, pollInterval: 60, listenClient: 'postgresql://db-direct/shop',
	handler: async ({ key, token, attempt, request, phase, phaseData, checkpoint, signal }) => {
		signal.throwIfAborted();
		if (phase === null)
			await checkpoint('charged', { charge: key });
		return { token, attempt, request, phaseData };
	},
	onClaim: ({ key, attempt, phase }) => console.log(key, attempt, phase),
	onFinish: ({ status, error }) => {
		const how: 'succeeded' | 'failed' | 'released' = status;
		void how; void error;
	},
});
await orders.start();
const taken: number = await orders.poll();
const up: boolean = orders.listening;
void taken; void up;
await orders.stop();
const http = completer({
	pool, kind: 'http', listenClient: false,
	handler: async ({ request }): Promise<CompletedResponse> => ({ status: 201, headers: { location: '/o/1' }, body: request }),
});
void http;
