
# Copyright: the idempotency extension authors.
#
# 203_hostile_input.pl: a seeded generator throws thousands of random calls
# at every client function (and idem_sweep): keys and scopes that are empty,
# NULL, 254/255/256/257 characters long (multi-byte characters right at the
# limit), full of quotes, backslashes, control characters, format directives,
# right-to-left marks, emoji and U+10FFFF; requests and bodies that are NULL,
# JSON null, 10,000 levels deep, megabytes large, exactly at and one byte over
# idempotency.max_response_size; zero, negative, sub-microsecond and
# overflowing intervals; NULL, unknown and near-miss statuses; random and
# extreme tokens (0, -1, 2^63-1, -2^63) next to the keys' real tokens; batch
# sizes of 0, -1 and 2^31-1; and calls as a superuser, as an unbound app role
# and as a role bound to a multi-byte scope prefix.
#
# Each call runs as a top-level statement (its own transaction, as an
# application would send it), followed by psql's :SQLSTATE and a fingerprint
# of everything the extension keeps: the live tuples of idempotency.keys
# (ctid and xmin, so any insert, update or delete shows), the token
# sequence, and this database's shared-memory counters.
#
# What it proves:
#   - the server never crashes: every call of every batch reports its
#     SQLSTATE, the postmaster's start time is unchanged at the end, the log
#     has no "terminated by signal" and no PANIC, pg_stat_activity answers;
#   - every input that the contract calls bad gets exactly the SQLSTATE that
#     the checks' documented order predicts (22004 NULL, 22023 empty key or
#     bad interval/status/batch, 22001 over 255 characters, 54000 body over
#     the limit, 42501 outside the role's scope prefix or idem_sweep for app
#     roles, 22023 too for a lease or retention over 10,000 years, however
#     far it is out of the timestamp range), and every valid input either
#     succeeds or (finish, extend,
#     release) gets one of the state errors P0002, 55000, 55006; never XX000
#     or P0001, never anything else;
#   - a rejected call changes nothing: not the table, not the sequence, not
#     the counters, and it draws no token;
#   - lookups and claims answered replay / in_progress / mismatch write
#     nothing and draw no token; a claimed outcome's token is the one after
#     the last claimed token (tokens come one after the other, from the
#     sequence or from the block it reserves ahead: a token drawn by any
#     call in between shows as a gap); every outcome row has the
#     columns the documented contract fills, and only those;
#   - afterwards every stored row is well-formed (key 1..255 characters,
#     scope at most 255, 32-byte fingerprint or NULL, body within the limit,
#     token not above the sequence, ...) and every live key, however hostile
#     its bytes, is found again by idem_lookup with its stored status.
#
# Run as described at the top of t/001_restart.pl.  Port 55447 only names the
# socket file.  HOSTILE_CALLS (default 6000) and HOSTILE_SEED (default
# 20251122) may be set in the environment; a failure prints the seed and the
# case so that it can be replayed.

use strict;
use warnings FATAL => 'all';

use Encode qw(encode_utf8);
use FindBin;
use lib "$FindBin::Bin/lib";
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $SEED   = $ENV{HOSTILE_SEED}  // 20251122;
my $NCALLS = $ENV{HOSTILE_CALLS} // 6000;
my $BATCH  = 500;
my $LIMIT  = 1048576;    # idempotency.max_response_size (default, 1MB)
srand($SEED);
note "seed $SEED, $NCALLS random calls";

my $node = new_node(
	'hostile',
	port => 55447,
	init => [ extra => [ '--encoding=UTF8', '--locale=C' ] ],
	conf => [
		'idempotency.sweep_interval = 0', 'log_statement = none',
		'log_min_error_statement = panic'
	]);
my $started = $node->safe_psql('postgres', 'SELECT pg_postmaster_start_time()');

my $TENANT_PREFIX = "t\x{eb}nant:";    # "tënant:" (ë is two bytes)

install_extension($node, 'postgres');
$node->safe_psql(
	'postgres', qq{
CREATE ROLE app LOGIN;
CREATE ROLE tenant LOGIN;
GRANT USAGE ON SCHEMA idempotency TO app, tenant;
SELECT idempotency.bind_scope('tenant', convert_from('\\x@{[ unpack('H*', encode_utf8($TENANT_PREFIX)) ]}', 'UTF8'));

CREATE SCHEMA h;
GRANT USAGE ON SCHEMA h TO PUBLIC;

-- Text from hex of its UTF-8 bytes: no quoting of hostile strings anywhere.
CREATE FUNCTION h.t(hex text) RETURNS text LANGUAGE sql IMMUTABLE
RETURN convert_from(decode(hex, 'hex'), 'UTF8');

-- A jsonb built in the server: kind and size, or JSON text as hex.
CREATE FUNCTION h.j(kind text, arg text) RETURNS jsonb LANGUAGE sql
RETURN CASE kind
	WHEN 'json' THEN h.t(arg)::jsonb
	WHEN 'deep_arr' THEN (repeat('[', arg::int) || repeat(']', arg::int))::jsonb
	WHEN 'deep_obj' THEN (repeat('{"\\u00e9\\\\": ', arg::int) || '"x"' || repeat('}', arg::int))::jsonb
	WHEN 'bigstr' THEN to_jsonb(repeat('x', arg::int))
	WHEN 'wide' THEN (SELECT jsonb_agg(i % 1000) FROM generate_series(1, arg::int) i)
	WHEN 'wideobj' THEN (SELECT jsonb_object_agg('k' || i, repeat(chr(9786), i % 7)) FROM generate_series(1, arg::int) i)
	END;

CREATE TABLE h.cases (
	id int PRIMARY KEY, fn text NOT NULL, role text,
	key text, scope text, request jsonb,
	token bigint, code int, body jsonb, status text,
	lease interval, retention interval, wait interval, batch int);
GRANT SELECT ON h.cases TO PUBLIC;

-- The current token of a key (app roles may not read the table).
CREATE FUNCTION h.cur_token(s text, k text) RETURNS bigint LANGUAGE sql
SECURITY DEFINER SET search_path = pg_catalog
RETURN (SELECT token FROM idempotency.keys WHERE scope = s AND key = k);
GRANT EXECUTE ON FUNCTION h.cur_token(text, text) TO PUBLIC;

-- Everything the extension keeps, in three parts: the table's live tuples,
-- the token sequence, this database's counters.
CREATE FUNCTION h.state() RETURNS text LANGUAGE sql
RETURN (SELECT coalesce(md5(string_agg(ctid::text || ':' || xmin::text, ',' ORDER BY ctid)), 'empty')
			|| ':' || count(*) FROM idempotency.keys)
	|| '|' || (SELECT last_value || ':' || is_called FROM idempotency.token_seq)
	|| '|' || coalesce((SELECT concat_ws(',', claims, takeovers, replays, in_progress,
				mismatches, finishes, releases, expired, reset)
			FROM idempotency.stats_counters()
			WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())),
		'none');
});

is( $node->safe_psql('postgres',
		"SELECT pg_column_size(h.j('bigstr', '" . ($LIMIT - 8) . "')) - 4"),
	$LIMIT, 'a jsonb string of limit - 8 characters is exactly max_response_size bytes');
SKIP:
{
	skip 'SQL edition: the settings are placeholders without the C library (SHOW fails until one is set)', 1
	  if sql_edition();
	is($node->safe_psql('postgres', "SHOW idempotency.max_response_size"),
		'1MB', 'max_response_size is the default 1MB');
}

# --- the generator -----------------------------------------------------------

sub pick { return $_[ int(rand(@_)) ]; }
sub chance { return rand() < $_[0]; }
sub hex_of { return unpack('H*', encode_utf8($_[0])); }

# Characters a hostile string is made of.
my @ascii   = map { chr } 0x20 .. 0x7e;
my @hostile = (
	"'", '"', '\\', '%', '_', '`', '$', ';', '--', '/*', '*/', ':x', '%s', '%n',
	'%d', '%%', '{', '}', '[', ']', '\\u0000', '\\x00', '$$', 'E\'',
	(map { chr } 0x01 .. 0x1f), chr(0x7f));
my @multi = map { chr } (
	0xe9, 0xdf, 0xa0, 0xad, 0x85, 0x300, 0x301, 0x3042, 0x4e2d, 0x5b57,
	0x200b, 0x200d, 0x202e, 0x2028, 0x2029, 0xfeff, 0xfffd, 0xffff, 0xe000,
	0x1f600, 0x1f9d1, 0x1f3fd, 0x10ffff, 0x10000);

sub rand_string
{
	my ($len) = @_;
	my $style = pick('ascii', 'hostile', 'multi', 'mixed', 'emoji');
	my $s     = '';
	while (length($s) < $len)
	{
		my $c =
			$style eq 'ascii'   ? pick(@ascii)
		  : $style eq 'hostile' ? pick(@hostile, @ascii)
		  : $style eq 'multi'   ? pick(@multi)
		  : $style eq 'emoji'   ? chr(0x1f600 + int(rand(80)))
		  :                       pick(@ascii, @hostile, @multi);
		$s .= $c;
	}
	return substr($s, 0, $len);
}

my @wild_lengths =
  (1, 1, 2, 3, 5, 8, 10, 10, 20, 30, 50, 100, 200, 254, 255, 255, 256, 257, 1000, 10000);

# Key and scope pools, so that calls meet each other's keys.
my @scope_pool = (
	'', '', 's1', "${TENANT_PREFIX}a", "${TENANT_PREFIX}b", $TENANT_PREFIX,
	"t\x{eb}nant", "T\x{cb}NANT:a", "${TENANT_PREFIX}\x{1f600}", "q'uote",
	"back\\slash", "tab\there", "nl\nline", '%s%n', 'x' x 255, "\x{e9}" x 255);

sub gen_name
{
	my ($is_scope) = @_;
	return undef if chance(0.02);
	return ''    if chance($is_scope ? 0.1 : 0.02);
	if (chance(0.6))
	{
		return pick(@scope_pool) if $is_scope;
		return 'k' . int(rand(40));
	}
	my $s = rand_string(pick(@wild_lengths));
	$s = $TENANT_PREFIX . $s if $is_scope && chance(0.3);
	return $s;
}

# A random JSON text (valid; control characters escaped, never \u0000).
sub json_string
{
	my ($s) = @_;
	$s =~ s/([\\"])/\\$1/g;
	$s =~ s/([\x01-\x1f])/sprintf('\\u%04x', ord($1))/ge;
	return '"' . $s . '"';
}

sub rand_json
{
	my ($depth) = @_;
	my $r = rand();
	if ($depth > 3 || $r < 0.4)
	{
		return pick(
			'null', 'true', 'false', '0', '-0', '1e1000', '-1.5e-300',
			'100', '100.0', '123456789012345678901234567890.123456789',
			json_string(rand_string(int(rand(20)))),
			'"\\ud83d\\ude00"', '"\\u00e9\\t\\n\\\\"');
	}
	if ($r < 0.7)
	{
		return '[' . join(', ', map { rand_json($depth + 1) } 1 .. int(rand(5))) . ']';
	}
	return '{'
	  . join(', ',
		map { json_string(rand_string(int(rand(12)))) . ': ' . rand_json($depth + 1) }
		  1 .. int(rand(5)))
	  . '}';
}

my @small_requests = ('{"a": 1}', '{"a": 1.0}', '[1, 2]', 'null', '"\\u0001\'\\\\"');

# A jsonb argument: [kind, arg] or undef for SQL NULL.
sub gen_request
{
	my ($pool_key) = @_;
	return undef if chance(0.15);
	if ($pool_key && chance(0.8))
	{
		return [ 'json', pick(@small_requests) ];
	}
	return [ 'deep_arr', 10000 ] if chance(0.01);
	return [ 'deep_obj', 10000 ] if chance(0.01);
	return [ 'bigstr', 2_000_000 ] if chance(0.005);
	return [ 'wide', 100_000 ] if chance(0.005);
	return [ 'json', rand_json(0) ];
}

sub gen_body
{
	return undef if chance(0.2);
	my $r = rand();
	return [ 'deep_arr', 10000 ] if $r < 0.01;
	return [ 'deep_obj', 10000 ] if $r < 0.02;
	return [ 'bigstr', pick(1000, 500_000, $LIMIT - 8, $LIMIT - 7, 2_000_000) ]
	  if $r < 0.04;
	return [ 'wide',    pick(1000, 60_000, 200_000) ] if $r < 0.05;
	return [ 'wideobj', pick(100, 30_000) ]           if $r < 0.06;
	return [ 'json', rand_json(0) ];
}

# Intervals: [SQL text, class]; classes pos, zero, neg, big (over the
# 10,000-year limit of a lease or retention, most of them also out of the
# timestamp range once added to now).
my @intervals = (
	[ '1 microsecond', 'pos' ], [ '1 ms', 'pos' ], [ '50 ms', 'pos' ],
	[ '1 second', 'pos' ], [ '1 hour', 'pos' ], [ '1 day', 'pos' ],
	[ '1 mon', 'pos' ], [ '1000 years', 'pos' ], [ '9999 years', 'pos' ],
	[ '0', 'zero' ], [ '00:00:00.0000001', 'zero' ], [ '-1 microsecond', 'neg' ],
	[ '-1 day', 'neg' ], [ '-1000 years', 'neg' ], [ '20000 years', 'big' ],
	[ '300000 years', 'big' ], [ '-300000 years', 'neg' ], [ '178000000 years', 'big' ],
	[ '2147483647 days', 'big' ], [ '-2147483648 months', 'neg' ]);
my @waits = (
	[ '0', 'zero' ], [ '0', 'zero' ], [ '1 microsecond', 'pos' ], [ '1 ms', 'pos' ],
	[ '20 ms', 'pos' ], [ '-1 microsecond', 'neg' ], [ '-1 day', 'neg' ],
	[ '-300000 years', 'neg' ], [ '-2147483648 months', 'neg' ]);
# (A positive wait too long to add to a timestamp is capped, not refused:
# it is valid, and would block on a key in progress, so the random calls
# never use one; the hand-written cases below do, on keys nobody holds.)

sub gen_interval
{
	my ($null_chance) = @_;
	return undef if chance($null_chance);
	return pick(grep { $_->[1] eq 'pos' } @intervals) if chance(0.6);
	return pick(@intervals);
}

my @bad_statuses = (
	'pending', 'SUCCEEDED', '', ' succeeded', 'succeeded ', "succeeded\n", 'ok',
	"s\x{fc}cceeded", 'failed;', "failed\x{200b}", '%s');
my @tokens_lit = (0, -1, 1, 2, '9223372036854775807', '-9223372036854775808');
my @used;    # [key, scope] of earlier claims

sub gen_case
{
	my ($id, $fn) = @_;
	my %c = (id => $id, fn => $fn);
	$c{role} = chance(0.8) ? undef : pick('app', 'tenant');
	if (@used && chance($fn eq 'claim' ? 0.4 : 0.6))
	{
		# A key an earlier claim used, so that calls meet each other.
		my $u = pick(@used);
		($c{key}, $c{scope}) = @$u[ 0, 1 ];
		$c{request} = $u->[2] if $fn eq 'claim' && chance(0.7);
	}
	else
	{
		$c{key}   = gen_name(0);
		$c{scope} = gen_name(1);
	}
	my $pool_key = defined $c{key} && $c{key} =~ /^k\d+$/;
	if ($fn eq 'claim')
	{
		$c{request} = gen_request($pool_key) unless exists $c{request};
		push @used, [ $c{key}, $c{scope}, $c{request} ] if @used < 2000;
		$c{lease}     = chance(0.6) ? pick([ '1 microsecond', 'pos' ], [ '1 hour', 'pos' ])
		  : gen_interval(0.3);
		$c{retention} = chance(0.5) ? pick([ '1 microsecond', 'pos' ], [ '1 day', 'pos' ])
		  : gen_interval(0.3);
		$c{wait}      = chance(0.03) ? undef : pick(@waits);
	}
	elsif ($fn eq 'finish' || $fn eq 'extend' || $fn eq 'release')
	{
		$c{tokmode} = chance(0.6) ? 'cur' : 'lit';
		$c{token} =
		  $c{tokmode} eq 'cur'
		  ? 1 + int(rand(5000))
		  : (chance(0.05) ? undef : pick(@tokens_lit, 1 + int(rand(3000))));
		if ($fn eq 'finish')
		{
			$c{code} = chance(0.1) ? undef
			  : pick(200, 201, 0, -1, 2147483647, '-2147483648', int(rand(1000)));
			$c{body}   = gen_body();
			$c{status} = chance(0.85)
			  ? pick('succeeded', 'failed')
			  : (chance(0.1) ? undef : pick(@bad_statuses, rand_string(5)));
			$c{retention} = gen_interval(0.6);
		}
		elsif ($fn eq 'extend')
		{
			$c{lease} = gen_interval(0.3);
		}
	}
	elsif ($fn eq 'sweep')
	{
		$c{batch} = chance(0.2) ? undef
		  : pick(0, -1, 1, 10, 1000, 2147483647, '-2147483648');
	}
	return \%c;
}

# --- hand-written boundary cases, then random ones ------------------------
my @cases;
my $next_id = 1;

sub add_case
{
	my (%c) = @_;
	$c{id} = $next_id++;
	$c{wait} = [ '0', 'zero' ] if $c{fn} eq 'claim' && !exists $c{wait};
	$c{scope} = '' unless exists $c{scope};
	$c{status} = 'succeeded' if $c{fn} eq 'finish' && !exists $c{status};
	push @cases, \%c;
	return \%c;
}

my @boundary_names = (
	'a' x 255, 'a' x 256, "\x{e9}" x 255, "\x{e9}" x 256,
	"\x{1f600}" x 255, "\x{1f600}" x 256, ('a' x 254) . "\x{1f600}",
	('a' x 255) . "\x{1f600}", "\x{10ffff}" x 255, ('b' x 254) . "\x{301}",
	"\x{3042}" x 128, ("\x{1}" x 255), ('\\' x 255), ("'" x 256), '',
	"\x{7f}", "\x{feff}", "\x{202e}evil", "%s%n%x%p", "\x{1f9d1}\x{1f3fd}");
foreach my $name (@boundary_names)
{
	add_case(fn => 'claim', key => $name, request => [ 'json', '{"b": 1}' ],
		lease => [ '1 hour', 'pos' ]);
	add_case(fn => 'claim', key => 'bk', scope => $name);
	add_case(fn => 'lookup', key => $name);
	add_case(fn => 'finish', key => $name, tokmode => 'cur', token => 1,
		code => 200, body => [ 'json', '{"done": true}' ]);
	add_case(fn => 'claim', key => $name, request => [ 'json', '{"b": 1}' ]);
}
# The response size limit, exactly.
foreach my $n ($LIMIT - 8, $LIMIT - 7)
{
	add_case(fn => 'claim', key => "size-$n", lease => [ '1 hour', 'pos' ]);
	add_case(fn => 'finish', key => "size-$n", tokmode => 'cur', token => 1,
		body => [ 'bigstr', $n ]);
}
# Deep and huge requests and bodies on one key.
add_case(fn => 'claim', key => 'deep', request => [ 'deep_obj', 10000 ],
	lease => [ '1 hour', 'pos' ]);
add_case(fn => 'finish', key => 'deep', tokmode => 'cur', token => 1,
	body => [ 'deep_arr', 10000 ]);
add_case(fn => 'claim', key => 'deep', request => [ 'deep_obj', 10000 ]);
add_case(fn => 'claim', key => 'deep', request => [ 'deep_arr', 10000 ]);
add_case(fn => 'claim', key => 'huge', request => [ 'bigstr', 3_000_000 ]);
add_case(fn => 'claim', key => 'huge', request => [ 'bigstr', 3_000_000 ]);
# A wait of 300,000 years is capped, not an error: on a key nobody holds
# (a new one, then one whose 1-microsecond lease is over) it claims at once.
add_case(fn => 'claim', key => 'hugewait', lease => [ '1 microsecond', 'pos' ],
	wait => [ '300000 years', 'pos' ]);
add_case(fn => 'claim', key => 'hugewait', wait => [ '300000 years', 'pos' ]);
# The lease and retention limit (10,000 years): 9999 years is fine, 20000 too
# large.  (Months count as 30 days there, so the exact edge in years is fuzzy.)
add_case(fn => 'claim', key => 'longlease', lease => [ '9999 years', 'pos' ],
	retention => [ '9999 years', 'pos' ]);
add_case(fn => 'claim', key => 'longlease2', lease => [ '20000 years', 'big' ]);
add_case(fn => 'claim', key => 'longlease2', retention => [ '20000 years', 'big' ]);
# NULL everywhere, one argument at a time.
add_case(fn => 'claim', key => undef);
add_case(fn => 'claim', key => 'n', scope => undef);
add_case(fn => 'claim', key => 'n', wait => undef);
add_case(fn => 'finish', key => 'n', token => undef, tokmode => 'lit');
add_case(fn => 'finish', key => 'n', token => 1, tokmode => 'lit', status => undef);
add_case(fn => 'extend', key => undef, token => 1, tokmode => 'lit');
add_case(fn => 'release', key => 'n', scope => undef, token => 1, tokmode => 'lit');
add_case(fn => 'lookup', key => undef);
add_case(fn => 'sweep', batch => undef);
add_case(fn => 'sweep', batch => 0);

my @fns = (('claim') x 8, ('finish') x 5, ('extend') x 2, ('release') x 2,
	('lookup') x 2, 'sweep');
for (1 .. $NCALLS)
{
	push @cases, gen_case($next_id++, pick(@fns));
}
note scalar(@cases) . ' cases';

# --- what the contract predicts --------------------------------------------

sub chars_of { return length($_[0]); }

# The SQLSTATE a bad argument must raise, in the order the function checks
# its arguments (the documented bad-input rules); undef when every argument is valid.
sub name_error
{
	my ($v, $allow_empty) = @_;
	return '22004' unless defined $v;
	return '22023' if $v eq '' && !$allow_empty;
	return '22001' if chars_of($v) > 255;
	return undef;
}

sub interval_error
{
	my ($iv) = @_;
	return undef unless defined $iv;
	return '22023' if $iv->[1] ne 'pos';
	return undef;
}

sub wait_error
{
	my ($iv) = @_;
	return '22004' unless defined $iv;
	return '22023' if $iv->[1] eq 'neg';
	return undef;
}

sub tenant_error
{
	my ($c) = @_;
	return undef unless defined $c->{role} && $c->{role} eq 'tenant';
	my $p = encode_utf8($TENANT_PREFIX);
	return substr(encode_utf8($c->{scope}), 0, length($p)) eq $p ? undef : '42501';
}

my %body_size;    # id => raw jsonb bytes, measured by the server

sub predict
{
	my ($c) = @_;
	my $fn = $c->{fn};
	my $e;
	if ($fn eq 'sweep')
	{
		return '42501' if defined $c->{role};    # not granted to PUBLIC
		return (defined $c->{batch} && $c->{batch} <= 0) ? '22023' : undef;
	}
	if ($fn eq 'claim')
	{
		$e = name_error($c->{key}, 0) // name_error($c->{scope}, 1)
		  // interval_error($c->{lease}) // interval_error($c->{retention})
		  // wait_error($c->{wait});
	}
	elsif ($fn eq 'finish')
	{
		$e = name_error($c->{key}, 0) // name_error($c->{scope}, 1)
		  // (defined $c->{token} ? undef : '22004')
		  // ((defined $c->{body} && $body_size{ $c->{id} } > $LIMIT) ? '54000' : undef)
		  // (!defined $c->{status} ? '22004'
			: ($c->{status} eq 'succeeded' || $c->{status} eq 'failed') ? undef
			: '22023')
		  // interval_error($c->{retention});
	}
	elsif ($fn eq 'extend')
	{
		$e = name_error($c->{key}, 0) // name_error($c->{scope}, 1)
		  // (defined $c->{token} ? undef : '22004')
		  // interval_error($c->{lease});
	}
	elsif ($fn eq 'release')
	{
		$e = name_error($c->{key}, 0) // name_error($c->{scope}, 1)
		  // (defined $c->{token} ? undef : '22004');
	}
	elsif ($fn eq 'lookup')
	{
		$e = name_error($c->{key}, 0) // name_error($c->{scope}, 1);
	}
	return $e // tenant_error($c);
}

# SQLSTATEs a valid call may end with: the state errors of the token calls.
my %state_errors = (
	claim   => {},
	lookup  => {},
	sweep   => {},
	finish  => { P0002 => 1, 55000 => 1, 55006 => 1 },
	extend  => { P0002 => 1, 55000 => 1, 55006 => 1 },
	release => { P0002 => 1, 55000 => 1, 55006 => 1 });

# --- load the cases ----------------------------------------------------------

sub sql_text { return defined $_[0] ? "h.t('" . hex_of($_[0]) . "')" : 'NULL'; }

sub sql_json
{
	my ($j) = @_;
	return 'NULL' unless defined $j;
	my $arg = $j->[0] eq 'json' ? hex_of($j->[1]) : $j->[1];
	return "h.j('$j->[0]', '$arg')";
}
sub sql_iv  { return defined $_[0] ? "'$_[0][0]'::interval" : 'NULL'; }
sub sql_num { return defined $_[0] ? "'$_[0]'" : 'NULL'; }

my $load = '';
foreach my $c (@cases)
{
	$load .= sprintf(
		"INSERT INTO h.cases VALUES (%d, '%s', %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s);\n",
		$c->{id}, $c->{fn},
		defined $c->{role} ? "'$c->{role}'" : 'NULL',
		sql_text($c->{key}), sql_text($c->{scope}), sql_json($c->{request}),
		sql_num($c->{token}), sql_num($c->{code}), sql_json($c->{body}),
		sql_text($c->{status}), sql_iv($c->{lease}), sql_iv($c->{retention}),
		sql_iv($c->{wait}), sql_num($c->{batch}));
}
$node->safe_psql('postgres', $load, timeout => 600);
is($node->safe_psql('postgres', 'SELECT count(*) FROM h.cases'),
	scalar(@cases), 'every generated case is valid input for PostgreSQL and loaded');

# The server's own measure of each body (raw jsonb bytes, as the limit counts).
foreach (split /\n/,
	$node->safe_psql('postgres',
		'SELECT id, pg_column_size(body::text::jsonb) - 4 FROM h.cases WHERE body IS NOT NULL'))
{
	my ($id, $size) = split /\|/;
	$body_size{$id} = $size;
}
cmp_ok(scalar(grep { $_ > $LIMIT } values %body_size), '>', 0,
	'some bodies are over the limit');

# Keys and scopes arrive byte for byte (hex round trip through the server).
my $roundtrip = '';
foreach my $c (grep { defined $_->{key} } @cases[ 0 .. 199 ])
{
	$roundtrip .= "SELECT $c->{id}, encode(convert_to(key, 'UTF8'), 'hex') FROM h.cases WHERE id = $c->{id};\n";
}
my $bad = 0;
foreach (split /\n/, $node->safe_psql('postgres', $roundtrip))
{
	my ($id, $hex) = split /\|/;
	$bad++ unless $hex eq hex_of($cases[ $id - 1 ]{key});
}
is($bad, 0, 'the first 200 keys reach the server byte for byte');

# --- run the calls -------------------------------------------------------------

sub call_sql
{
	my ($c) = @_;
	my $id  = $c->{id};
	my $tok =
	  ($c->{tokmode} // '') eq 'cur'
	  ? 'coalesce(h.cur_token(c.scope, c.key), c.token)'
	  : 'c.token';
	my $from = "FROM h.cases c WHERE c.id = $id";
	if ($c->{fn} eq 'claim')
	{
		return "SELECT 'R|$id|' || concat_ws('|', r.outcome, coalesce(r.token::text, '~'), "
		  . "coalesce(r.attempt::text, '~'), coalesce(r.status, '~'), "
		  . "coalesce(r.response_code::text, '~'), coalesce(md5(r.response_body::text), '~'), "
		  . "coalesce(r.retry_after::text, '~')) FROM h.cases c, LATERAL "
		  . "idempotency.idem_claim(c.key, c.request, c.scope, c.lease, c.retention, c.wait) r "
		  . "WHERE c.id = $id;";
	}
	if ($c->{fn} eq 'finish')
	{
		return "SELECT 'R|$id|' || coalesce(idempotency.idem_finish(c.key, $tok, c.code, "
		  . "c.body, c.scope, c.status, c.retention)::text, '~') $from;";
	}
	if ($c->{fn} eq 'extend')
	{
		return "SELECT 'R|$id|' || coalesce((idempotency.idem_extend(c.key, $tok, c.lease, "
		  . "c.scope) > clock_timestamp() - interval '1 s')::text, '~') $from;";
	}
	if ($c->{fn} eq 'release')
	{
		return "SELECT 'R|$id|' || idempotency.idem_release(c.key, $tok, c.scope)::text $from;";
	}
	if ($c->{fn} eq 'lookup')
	{
		return "SELECT 'R|$id|' || concat_ws('|', r.status, r.attempt) FROM h.cases c, LATERAL "
		  . "idempotency.idem_lookup(c.key, c.scope) r WHERE c.id = $id;";
	}
	return "SELECT 'R|$id|' || r.expired || '|' || r.reset FROM h.cases c, LATERAL "
	  . "idempotency.idem_sweep(c.batch) r WHERE c.id = $id;";
}

my (%result, %sqlstate, %state_after);
my $initial = $node->safe_psql('postgres', 'SELECT h.state()');
my $batches_complete = 0;
my $nbatches = 0;
for (my $i = 0; $i < @cases; $i += $BATCH)
{
	my @batch = @cases[ $i .. ($i + $BATCH > @cases ? $#cases : $i + $BATCH - 1) ];
	my $script = "\\set VERBOSITY terse\n";
	foreach my $c (@batch)
	{
		$script .= "SET ROLE $c->{role};\n" if defined $c->{role};
		$script .= call_sql($c) . "\n";
		$script .= "\\echo S $c->{id} :SQLSTATE\n";
		$script .= "RESET ROLE;\n" if defined $c->{role};
		$script .= "SELECT 'C|$c->{id}|' || h.state();\n";
	}
	my ($out, $err) = ('', '');
	$node->psql('postgres', $script,
		stdout => \$out, stderr => \$err, on_error_stop => 0, timeout => 900);
	my $seen = 0;
	foreach my $line (split /\n/, $out)
	{
		if ($line =~ /^R\|(\d+)\|(.*)$/) { $result{$1} = $2; }
		elsif ($line =~ /^S (\d+) (\S+)$/) { $sqlstate{$1} = $2; $seen++; }
		elsif ($line =~ /^C\|(\d+)\|(.*)$/) { $state_after{$1} = $2; }
	}
	$nbatches++;
	$batches_complete++ if $seen == @batch;
	diag "batch at case $batch[0]{id}: $seen of " . scalar(@batch) . " calls reported"
	  if $seen != @batch;
}
is($batches_complete, $nbatches, "every call of all $nbatches batches reported its SQLSTATE");

# --- check every call ------------------------------------------------------------

my (@wrong_state, @changed, @bad_rows, @order);
my %seen_state;
my %seen_outcome;
my $prev      = $initial;
my $max_token = 0;
foreach my $c (@cases)
{
	my $id    = $c->{id};
	my $st    = $sqlstate{$id} // 'missing';
	my $after = $state_after{$id} // 'missing';
	my $pred  = predict($c);
	my $what  = "case $id ($c->{fn}" . (defined $c->{role} ? " as $c->{role}" : '') . ')';
	$seen_state{$st}++;

	if (defined $pred)
	{
		push @wrong_state, "$what: expected $pred, got $st" unless $st eq $pred;
	}
	elsif ($st ne '00000' && !$state_errors{ $c->{fn} }{$st})
	{
		push @wrong_state, "$what: valid input, got $st";
	}

	my ($tab0, $seq0, $cnt0) = split /\|/, $prev,  -1;
	my ($tab1, $seq1, $cnt1) = split /\|/, $after, -1;
	if ($st ne '00000')
	{
		push @changed, "$what: rejected with $st but changed the state ($prev -> $after)"
		  unless $after eq $prev;
	}
	elsif ($c->{fn} eq 'lookup')
	{
		push @changed, "$what: a lookup changed the state" unless $after eq $prev;
		my $r = $result{$id};
		push @bad_rows, "$what: lookup row '$r'"
		  if defined $r && $r !~ /^(pending|succeeded|failed)\|[1-9]\d*$/;
	}
	elsif ($c->{fn} eq 'claim')
	{
		my @f = split /\|/, ($result{$id} // ''), -1;
		my %r;
		@r{qw(outcome token attempt status code body retry)} = @f;
		$seen_outcome{ $r{outcome} // 'none' }++;
		if (@f != 7)
		{
			push @bad_rows, "$what: claim row '" . ($result{$id} // 'none') . "'";
		}
		elsif ($r{outcome} eq 'claimed')
		{
			push @bad_rows, "$what: claimed row '$result{$id}'"
			  unless $r{token} =~ /^\d+$/ && $r{attempt} =~ /^[1-9]\d*$/
			  && "$r{status}$r{code}$r{body}$r{retry}" eq '~~~~';
			push @order, "$what: token $r{token} not above $max_token"
			  unless $r{token} =~ /^\d+$/ && $r{token} > $max_token;
			# One session draws tokens, one after the other (from the
			# sequence, or from the block it reserves ahead when preloaded):
			# a call in between that drew one shows as a gap.
			push @order, "$what: token $r{token} is not the one after $max_token"
			  unless $r{token} =~ /^\d+$/ && $r{token} == $max_token + 1;
			$max_token = $r{token} if $r{token} =~ /^\d+$/;
		}
		else
		{
			push @changed, "$what: claim answered $r{outcome} but wrote or drew a token"
			  unless $tab1 eq $tab0 && $seq1 eq $seq0;
			my $ok =
				$r{outcome} eq 'replay'
			  ? ($r{status} =~ /^(succeeded|failed)$/ && "$r{token}$r{attempt}$r{retry}" eq '~~~')
			  : $r{outcome} eq 'in_progress'
			  ? ($r{retry} =~ /^[1-9]\d*$/ && "$r{token}$r{attempt}$r{status}$r{code}$r{body}" eq '~~~~~')
			  : $r{outcome} eq 'mismatch'
			  ? ("$r{token}$r{attempt}$r{status}$r{code}$r{body}$r{retry}" eq '~~~~~~')
			  : 0;
			push @bad_rows, "$what: $r{outcome} row '$result{$id}'" unless $ok;
		}
	}
	elsif ($c->{fn} eq 'finish' || $c->{fn} eq 'extend')
	{
		my $r = $result{$id} // 'none';
		push @bad_rows, "$what: returned '$r'"
		  unless $c->{fn} eq 'finish' ? $r =~ /^\d{4,}-\d\d-\d\d / : $r eq 'true';
	}
	elsif ($c->{fn} eq 'sweep')
	{
		push @bad_rows, "$what: returned '" . ($result{$id} // 'none') . "'"
		  unless ($result{$id} // '') =~ /^\d+\|\d+$/;
	}
	$prev = $after;
}

sub report
{
	my ($list, $name) = @_;
	is(scalar(@$list), 0, $name) or diag join("\n", @$list[ 0 .. ($#$list > 19 ? 19 : $#$list) ]);
}
report(\@wrong_state, 'every call ends with its predicted or an allowed SQLSTATE');
report(\@changed,     'rejected calls, lookups and non-claiming claims change nothing');
report(\@bad_rows,    'every result row has the documented shape');
report(\@order,       'claimed tokens come one after the other: no other call drew one');
is($seen_state{XX000} // 0, 0, 'no internal error (XX000)');
is($seen_state{P0001} // 0, 0, 'no generic raise_exception (P0001)');
note 'SQLSTATEs: ' . join(', ', map { "$_ x$seen_state{$_}" } sort keys %seen_state);
note 'claim outcomes: ' . join(', ', map { "$_ x$seen_outcome{$_}" } sort keys %seen_outcome);

# The generator reached every kind of rejection and every outcome.
foreach my $st (qw(00000 22004 22023 22001 54000 42501 P0002 55000 55006))
{
	cmp_ok($seen_state{$st} // 0, '>', 0, "the run includes calls ending with $st");
}
foreach my $o (qw(claimed replay in_progress mismatch))
{
	cmp_ok($seen_outcome{$o} // 0, '>', 0, "the run includes claims answered $o");
}

# Hand-written boundaries: the exact outcome of a few.
sub first_case
{
	my ($fn, $key) = @_;
	foreach (@cases)
	{
		return $_ if $_->{fn} eq $fn && defined $_->{key} && $_->{key} eq $key;
	}
	die "no $fn case for that key";
}
foreach my $k ("\x{e9}" x 255, "\x{1f600}" x 255, ('a' x 254) . "\x{1f600}", "\x{10ffff}" x 255)
{
	my $c = first_case('claim', $k);
	like($result{ $c->{id} } // '', qr/^claimed\|\d+\|1\|/,
		'a 255-character key of ' . length(encode_utf8($k)) . ' bytes is claimed');
}
foreach my $k ("\x{e9}" x 256, ('a' x 255) . "\x{1f600}", "'" x 256)
{
	my $c = first_case('claim', $k);
	is($sqlstate{ $c->{id} }, '22001',
		'a 256-character key of ' . length(encode_utf8($k)) . ' bytes is refused (22001)');
}
is($sqlstate{ first_case('finish', 'size-' . ($LIMIT - 8))->{id} },
	'00000', 'a body of exactly max_response_size bytes is stored');
is($sqlstate{ first_case('finish', 'size-' . ($LIMIT - 7))->{id} },
	'54000', 'a body one byte over max_response_size is refused (54000)');
my @deep = grep { defined $_->{key} && $_->{key} eq 'deep' } @cases;
like($result{ $deep[0]{id} }, qr/^claimed\|/,        'a 10,000-level deep request is claimed');
is($sqlstate{ $deep[1]{id} }, '00000',               'a 10,000-level deep body is stored');
like($result{ $deep[2]{id} }, qr/^replay\|~\|~\|succeeded\|~\|[0-9a-f]{32}\|~$/,
	'the deep key replays its deep body');
like($result{ $deep[3]{id} }, qr/^mismatch\|/,       'another deep request is a mismatch');
my @huge = grep { defined $_->{key} && $_->{key} eq 'huge' } @cases;
like($result{ $huge[0]{id} }, qr/^claimed\|/,     'a 3 MB request is claimed');
like($result{ $huge[1]{id} }, qr/^in_progress\|/, 'the same 3 MB request again is in progress');
my @hugewait = grep { defined $_->{key} && $_->{key} eq 'hugewait' } @cases;
like($result{ $hugewait[0]{id} }, qr/^claimed\|\d+\|1\|/,
	'a claim with a 300,000-year wait on a new key is claimed at once');
like($result{ $hugewait[1]{id} }, qr/^claimed\|\d+\|2\|/,
	'and again, taking over the lapsed lease, as attempt 2');
like($result{ first_case('claim', 'longlease')->{id} }, qr/^claimed\|/,
	'a lease and a retention of 9999 years are accepted');
is(scalar(grep { $sqlstate{ $_->{id} } eq '22023' }
		  grep { defined $_->{key} && $_->{key} eq 'longlease2' } @cases),
	2, 'a lease or a retention of 20000 years is refused (22023)');

# --- the server afterwards -------------------------------------------------------
is($node->safe_psql('postgres', 'SELECT pg_postmaster_start_time()'),
	$started, 'the postmaster never restarted');
is($node->safe_psql('postgres',
		"SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' "
		  . "AND pid = pg_backend_pid()"),
	'1', 'pg_stat_activity answers');
my $log = slurp_file($node->logfile);
unlike($log, qr/terminated by signal|was terminated|PANIC:|(?:server process|client backend) .* exited/,
	'the server log shows no crashed backend');
unlike($log, qr/TRAP:|AddressSanitizer|runtime error:/,
	'the server log shows no assertion or sanitizer report');

# Every stored row is well-formed.
is( $node->safe_psql(
		'postgres', qq{
SELECT count(*) FROM idempotency.keys
 WHERE NOT (char_length(key) BETWEEN 1 AND 255
	AND char_length(scope) <= 255
	AND status IN ('pending', 'succeeded', 'failed')
	AND attempt >= 1
	AND (fingerprint IS NULL OR octet_length(fingerprint) = 32)
	AND (token IS NULL OR token <= (SELECT last_value FROM idempotency.token_seq))
	AND (status = 'pending') = (finished_at IS NULL)
	AND (status = 'pending') = (lease_until IS NOT NULL)
	AND (response_body IS NULL OR pg_column_size(response_body::text::jsonb) - 4 <= $LIMIT)
	AND expires_at > created_at)}),
	'0', 'every stored row is well-formed');

# Every live key, however hostile its bytes, is found again by idem_lookup.
is( $node->safe_psql(
		'postgres', q{
SELECT count(*) FROM idempotency.keys k
 WHERE k.expires_at > clock_timestamp() + interval '1 minute'
   AND NOT EXISTS (SELECT 1 FROM idempotency.idem_lookup(k.key, k.scope) l
				   WHERE l.status = k.status AND l.attempt = k.attempt)}),
	'0', 'idem_lookup finds every live key with its stored status and attempt');
cmp_ok(
	$node->safe_psql('postgres',
		"SELECT count(*) FROM idempotency.keys WHERE key ~ '[^[:ascii:]]' OR key ~ '[[:cntrl:]]'"),
	'>', 0, 'keys with non-ASCII and control characters are stored');

$node->stop;
done_testing();
