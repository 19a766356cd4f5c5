// A body parser mounted after the Express middleware (app-wide, or in the
// route after it) still gets the whole body the middleware read for the
// fingerprint: every express.* parser, in both orders, on Express 5 and 4.
import { test, describe, after } from 'node:test';
import assert from 'node:assert/strict';
import pg from 'pg';
import { expressIdempotency } from 'pg-idempotency';
import { db, row, newKey, send, expresses, listen } from './helpers.mjs';

const pool = new pg.Pool({ max: 4 });

after(async () => {
	await pool.end();
	await db.end();
});

/* what each parser makes of its body, as the handler sends it back */
const parsers = [
	{ name: 'json', type: 'application/json', body: '{"amount": 100, "note": "x"}', other: '{"amount": 101}', parsed: { amount: 100, note: 'x' } },
	{ name: 'urlencoded', type: 'application/x-www-form-urlencoded', body: 'amount=100&note=x', other: 'amount=101', parsed: { amount: '100', note: 'x' } },
	{ name: 'text', type: 'text/plain', body: 'pay 100', other: 'pay 101', parsed: 'pay 100' },
	{ name: 'raw', type: 'application/octet-stream', body: 'raw\u0000bytes', other: 'raw bytes', parsed: Buffer.from('raw\u0000bytes').toString('base64') },
];

const show = (body) => (Buffer.isBuffer(body) ? body.toString('base64') : body);

async function start(major, parser, order) {
	const express = expresses[major];
	const app = express();
	const idem = expressIdempotency({ pool });
	const bodyParser = express[parser.name]();
	const handler = (req, res) => res.status(201).json({ body: show(req.body), attempt: req.idempotency?.attempt });
	if (order === 'app') {
		app.use(idem);
		app.use(bodyParser);
		app.post('/x', handler);
	} else {
		app.post('/x', idem, bodyParser, handler);
	}
	return listen(app);
}

for (const major of Object.keys(expresses)) {
	describe(major, () => {
		for (const parser of parsers) {
			for (const order of ['app', 'route']) {
				test(`express.${parser.name}() after the middleware (${order === 'app' ? 'app.use' : 'in the route'})`, async () => {
					const app = await start(major, parser, order);
					try {
						const key = newKey();
						const first = await send(app.url, '/x', { key, type: parser.type, body: parser.body });
						assert.equal(first.status, 201, first.text);
						assert.deepEqual(JSON.parse(first.text), { body: parser.parsed, attempt: 1 });
						assert.equal((await row(key)).status, 'succeeded');
						const again = await send(app.url, '/x', { key, type: parser.type, body: parser.body });
						assert.equal(again.headers['idempotent-replayed'], 'true');
						const other = await send(app.url, '/x', { key, type: parser.type, body: parser.other });
						assert.equal(other.status, 422, 'the fingerprint is of the bytes the parser got');
						// without a key the request is refused before any parser reads it
						const plain = await send(app.url, '/x', { type: parser.type, body: parser.body });
						assert.equal(plain.status, 400);
					} finally {
						await app.close();
					}
				});
			}
		}
	});
}

/*
 * An empty body has ended by the time the middleware reads it when anything
 * awaited first: an async key(req), an async middleware in front.  The
 * request still gets its answer (the signal only bounds a failure).
 */
for (const major of Object.keys(expresses)) {
	describe(`${major}: an empty body that ended before the middleware read it`, () => {
		const ways = {
			'key(req) option, parser after the middleware': (express) => {
				const app = express();
				app.use(expressIdempotency({ pool, key: async (req) => req.headers['x-message-id'] ?? null }));
				app.use(express.json());
				return app;
			},
			'an async middleware before it': (express) => {
				const app = express();
				app.use(async (req, res, next) => {
					await db.query('SELECT 1');
					next();
				});
				app.use(expressIdempotency({ pool, key: (req) => req.headers['x-message-id'] ?? null }));
				return app;
			},
		};
		for (const [name, build] of Object.entries(ways)) {
			test(name, async () => {
				const app = build(expresses[major]);
				app.post('/x', (req, res) => res.status(201).json({ attempt: req.idempotency?.attempt, bytes: req.rawBody?.length }));
				const server = await listen(app);
				try {
					const id = newKey('msg');
					const opts = { body: '', headers: { 'x-message-id': id }, signal: AbortSignal.timeout(10000) };
					const first = await send(server.url, '/x', opts);
					assert.equal(first.status, 201, first.text);
					assert.deepEqual(JSON.parse(first.text), { attempt: 1, bytes: 0 });
					assert.equal((await row(id)).status, 'succeeded');
					const again = await send(server.url, '/x', { ...opts, signal: AbortSignal.timeout(10000) });
					assert.equal(again.headers['idempotent-replayed'], 'true');
				} finally {
					await server.close();
				}
			});
		}
	});
}
